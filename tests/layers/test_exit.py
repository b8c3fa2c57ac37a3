"""The exit criteria and the energy-safe step as units (energyformer.layers.exit / .monotone;
docs/inference_compute.md §2, §5): the ``name:threshold`` parser and its errors, each criterion
firing exactly where a constructed case says, a user's own criterion, and the halving rule
against a per-token reference loop."""
import pytest
import torch

from energyformer.layers.exit import EXIT_CRITERIA, ExitCriterion, ExitState, ExitView, parse_exit
from energyformer.layers.monotone import accept_lower_energy_step


@pytest.mark.parametrize("spec, name, threshold", [
    ("kl:1e-3", "kl", 1e-3), ("rel:0.03", "rel", 0.03), ("abs:0", "abs", 0.0), (" energy:2 ", "energy", 2.0),
    ("grad", "grad", EXIT_CRITERIA.get("grad").default_threshold)])
def test_parse_exit_reads_name_and_threshold(spec, name, threshold):
    crit = parse_exit(spec)
    assert crit.name == name and crit.threshold == threshold
    assert parse_exit(crit.spec()) == crit and parse_exit(crit) is crit


@pytest.mark.parametrize("spec", [None, "", "none", "off"])
def test_parse_exit_none(spec):
    assert parse_exit(spec) is None


@pytest.mark.parametrize("spec, message", [
    ("klx:1e-3", "unknown exit criterion 'klx'.*known criteria: abs, rel, kl, energy, grad"),
    ("kl:abc", "threshold 'abc' is not a number"),
    ("kl:", "threshold '' is not a number"),
    ("rel:-1", "threshold '-1' must be a finite number >= 0"),
    ("rel:nan", "threshold 'nan' must be"),
    ("abs:inf", "threshold 'inf' must be"),
    (3, "must be a string 'name:threshold'")])
def test_parse_exit_errors_name_the_bad_value(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_exit(spec)


def view(**kw):
    x0 = torch.zeros(1, 4, 3)
    return ExitView(t=0, x_prev=kw.pop("x_prev", x0), x_new=kw.pop("x_new", x0), **kw)


def test_state_change_criteria_fire_where_the_change_is_small():
    x_prev = torch.ones(1, 4, 3)
    x_new = x_prev.clone()
    x_new[0, 1, 0] += 0.5     # token 1 moves by 0.5
    x_new[0, 2] *= 1.01       # token 2 moves by 1% of its norm (0.01·sqrt 3 absolute)
    x_new[0, 3, 2] += 1e-4    # token 3 barely moves
    v = view(x_prev=x_prev, x_new=x_new)
    assert parse_exit("abs:0.1").fires(v).tolist() == [[True, False, True, True]]
    assert parse_exit("abs:0.01").fires(v).tolist() == [[True, False, False, True]]
    rel = parse_exit("rel:0.02").score(v)
    torch.testing.assert_close(rel[0, 2], torch.tensor(0.01 / 1.01))
    assert parse_exit("rel:0.02").fires(v).tolist() == [[True, False, True, True]]
    assert parse_exit("abs:0").fires(v).tolist() == [[False] * 4]  # a zero threshold never fires


def test_kl_fires_where_the_next_token_distribution_settled():
    old = torch.tensor([[[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    new = old.clone()
    new[0, 1] = torch.tensor([0.0, 2.0, 0.0])   # token 1 changed its mind
    new[0, 2] += 5.0                              # a shift of every logit: the same distribution
    v = ExitView(0, torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), logits_prev=old, logits_new=new)
    score = parse_exit("kl").score(v)
    p, q = new[0, 1].softmax(-1), old[0, 1].softmax(-1)
    torch.testing.assert_close(score[0, 1], (p * (p.log() - q.log())).sum())
    assert parse_exit("kl:1e-3").fires(v).tolist() == [[True, False, True]]


def test_energy_and_grad_criteria():
    v = view(energy_prev=torch.tensor([[1.0, 1.0, 1.0, 1.0]]), energy_new=torch.tensor([[1.0, 0.5, 0.9999, 3.0]]),
             grad_new=torch.tensor([[[0.0, 0.0, 0.0], [3.0, 4.0, 0.0], [0.0, 1e-3, 0.0], [1.0, 0.0, 0.0]]]))
    assert parse_exit("energy:1e-3").fires(v).tolist() == [[True, False, True, False]]
    torch.testing.assert_close(parse_exit("grad").score(v), torch.tensor([[0.0, 5.0, 1e-3, 1.0]]))
    assert parse_exit("grad:0.01").fires(v).tolist() == [[True, False, True, False]]


def test_exit_state_freezes_exited_tokens_and_counts_steps():
    x = torch.zeros(1, 3, 2)
    state = ExitState("abs:0.5", x, set(), "toy")
    moves = torch.tensor([[[1.0, 0], [0.1, 0], [1.0, 0]]])
    x1 = state.apply(x, x + moves)
    assert state.update(ExitView(0, x, x1))           # token 1 moved by 0.1 < 0.5: exits
    x2 = state.apply(x1, x1 + moves)
    assert torch.equal(x2[0, 1], x1[0, 1])             # it no longer moves
    assert state.steps.tolist() == [[2, 1, 2]]


def test_a_criterion_the_model_cannot_compute_raises_naming_the_usable_ones():
    with pytest.raises(ValueError, match="'energy' needs \\['energy'\\].*usable criteria here: abs, rel, kl"):
        ExitState("energy:1e-3", torch.zeros(1, 2, 3), {"logits"}, "the recurrent GPT")


def test_a_user_criterion_registers_and_parses():
    @EXIT_CRITERIA.register("toy_first_token")
    class FirstToken(ExitCriterion):
        """Exit position 0 after its first step (a test criterion)."""

        def score(self, view):
            s = torch.ones(view.x_new.shape[:-1])
            s[:, 0] = 0.0
            return s

    try:
        crit = parse_exit("toy_first_token:0.5")
        assert isinstance(crit, FirstToken) and crit.fires(view()).tolist() == [[True, False, False, False]]
        with pytest.raises(ValueError, match="known criteria: .*toy_first_token"):
            parse_exit("nope")
    finally:
        EXIT_CRITERIA.unregister("toy_first_token")


# ---------------------------------------------------------------------------------------- monotone
def reference_accept(x, x_full, energy_of_token, max_halvings):
    """Per token, in Python: try s = 1, 1/2, ...; keep the first step that does not raise its energy."""
    out = x.clone()
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            e_old = energy_of_token(x[b, i])
            for k in range(max_halvings + 1):
                cand = x_full[b, i] if k == 0 else x[b, i] - 0.5 ** k * (x[b, i] - x_full[b, i])
                if energy_of_token(cand) <= e_old:
                    out[b, i] = cand
                    break
    return out


@pytest.mark.parametrize("max_halvings", [0, 1, 4])
def test_accept_lower_energy_step_equals_the_per_token_reference(max_halvings):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, dtype=torch.float64)
    grad = x  # E = ½‖x‖²: the step x − η x overshoots for η > 2
    eta = torch.tensor([0.5, 1.5, 2.5, 3.5, 10.0, 30.0, 100.0], dtype=torch.float64)[None, :, None]
    x_full = x - eta * grad

    def energy(s):
        return 0.5 * (s * s).sum(-1)

    got = accept_lower_energy_step(x, x_full, energy, max_halvings)
    torch.testing.assert_close(got, reference_accept(x, x_full, lambda v: 0.5 * (v * v).sum(), max_halvings),
                               rtol=0, atol=0)
    assert bool((energy(got) <= energy(x)).all())
    assert torch.equal(got[:, :2], x_full[:, :2])       # η < 2 descends: the plain step, bit for bit
    if max_halvings == 0:
        assert torch.equal(got[:, 2:], x[:, 2:])        # no halving allowed: rejected


def test_accept_lower_energy_step_rejects_bad_max_halvings():
    x = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="max_halvings"):
        accept_lower_energy_step(x, x, lambda s: s.sum(-1), -1)


@pytest.mark.parametrize("exit", ["abs:1e9", "abs:1e-2"])
def test_an_exit_in_a_forward_with_gradients_backpropagates(exit):
    """``exit=`` with gradients on: the per-token freeze (``where(active, …)``) keeps its mask for
    the backward, so the next step's update of ``active`` must not overwrite it in place. A
    criterion that fires at once gives the gradients of the steps each token took."""
    from energyformer.layers.cem import CEMBlock

    torch.manual_seed(0)
    block = CEMBlock(16, 4, 24, attn_n_steps=3, mlp_n_steps=3).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    y = block(x, exit=exit)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    assert torch.isfinite(gx).all()
    if exit == "abs:1e9":  # fires after the first step everywhere: one step in each sub-block
        y1 = block(x, n_steps=1)
        torch.testing.assert_close(y, y1, atol=1e-12, rtol=0)
        torch.testing.assert_close(gx, torch.autograd.grad(y1.square().sum(), x)[0], atol=1e-10, rtol=0)
