"""Energy as an uncertainty signal (docs/inference_compute.md §6): the correlation inspect reports,
against values worked out by hand."""
import pytest
import torch

from energyformer.inspect.energy import energy_loss_correlation


def test_pearson_and_spearman_by_hand():
    e = torch.tensor([1.0, 2.0, 3.0, 4.0])
    loss = torch.tensor([1.0, 4.0, 9.0, 16.0])  # monotone, not linear
    got = energy_loss_correlation(e, loss)
    assert got["n"] == 4 and got["spearman"] == pytest.approx(1.0)
    # Pearson by hand: centred e = (-1.5, -0.5, 0.5, 1.5), centred loss = (-6.5, -3.5, 1.5, 8.5)
    num = 1.5 * 6.5 + 0.5 * 3.5 + 0.5 * 1.5 + 1.5 * 8.5
    den = (2 * 1.5 ** 2 + 2 * 0.5 ** 2) ** 0.5 * (6.5 ** 2 + 3.5 ** 2 + 1.5 ** 2 + 8.5 ** 2) ** 0.5
    assert got["pearson"] == pytest.approx(num / den)
    assert energy_loss_correlation(e, -loss)["spearman"] == pytest.approx(-1.0)


def test_spearman_gives_ties_their_mean_rank():
    e = torch.tensor([1.0, 1.0, 2.0, 3.0])      # ranks 1.5, 1.5, 3, 4
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])   # ranks 1, 2, 3, 4
    r = torch.tensor([1.5, 1.5, 3.0, 4.0]) - 2.5
    s = torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5
    assert energy_loss_correlation(e, loss)["spearman"] == pytest.approx(float((r * s).sum() / (r.norm() * s.norm())))


def test_too_few_tokens_or_a_constant_series_give_none():
    assert energy_loss_correlation(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0]))["pearson"] is None
    got = energy_loss_correlation(torch.ones(5), torch.arange(5.0))
    assert got["pearson"] is None and got["spearman"] is None
    with pytest.raises(ValueError, match="1-D of one length"):
        energy_loss_correlation(torch.ones(3), torch.ones(4))


def test_matches_scipy_on_random_data_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    e = torch.randint(0, 6, (40,), generator=g).double()   # many ties
    loss = e + torch.randn(40, generator=g, dtype=torch.float64)
    got = energy_loss_correlation(e, loss)
    assert got["pearson"] == pytest.approx(stats.pearsonr(e.numpy(), loss.numpy())[0], abs=1e-12)
    assert got["spearman"] == pytest.approx(stats.spearmanr(e.numpy(), loss.numpy())[0], abs=1e-12)
