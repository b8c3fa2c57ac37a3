"""Measured training FLOPs per token (energyformer.models.flops) against hand counts, causal
attention charged for the N(N+1)/2 pairs of its mask (the module's convention)."""
import pytest
import torch

from energyformer.energies.heads import force_attention_path
from energyformer.models.flops import causal_pairs, flop_counter, training_flops_per_token
from energyformer.models.registry import build_model

V, N, D = 50, 32, 64


def _model(**kw):
    return build_model(dict(vocab_size=V, block_size=N, d_model=D, n_heads=4, **kw))


# per layer and token: 4·d per causal pair forward (scores, sum) + 10·d backward (PyTorch's SDPA
# count, which recomputes the scores), over the N(N+1)/2 pairs of the causal mask
ATTN = 14 * D * (N * (N + 1) // 2) // N


def test_gpt_matches_the_hand_count():
    """3 × 2 · (matmul parameters) + per layer the attention products over the causal pairs."""
    L, d_ff = 2, 4 * D
    per_layer = 4 * D * D + 2 * D * d_ff
    assert training_flops_per_token(_model(arch="gpt", n_layers=L)) == 6 * (L * per_layer + D * V) + L * ATTN


@pytest.mark.parametrize("arch", ["nrgpt", "gpt_rec"])
def test_every_recurrent_step_is_counted(arch):
    counts = [training_flops_per_token(_model(arch=arch, n_steps=t)) for t in (1, 2, 3)]
    step = counts[1] - counts[0]
    assert step > 0 and counts[2] - counts[1] == pytest.approx(step)


def test_cem_second_step_skips_keys_and_the_mlp_context():
    """CEM T=2 adds a step without k_proj (keys are fixed) and without the MLP's fixed branch W_U ĥ."""
    one = training_flops_per_token(_model(arch="cem", n_layers=1, n_steps=1, d_ff=96))
    two = training_flops_per_token(_model(arch="cem", n_layers=1, n_steps=2, d_ff=96))
    head = 3 * 2 * D * V
    # per step: q and qᵀ (2·d²) and the attention products in attention; W g and Wᵀ (2·d·d_ff) in the MLP
    extra = 6 * (2 * D * D + 2 * D * 96) + ATTN
    assert two - one == pytest.approx(extra)
    assert one > head


def test_counting_leaves_no_gradients_and_the_rng_untouched():
    model = _model(arch="gpt", n_layers=1, dropout=0.1)
    state = torch.get_rng_state()
    training_flops_per_token(model)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_causal_pairs():
    assert causal_pairs(1, 1) == 1 and causal_pairs(4, 4) == 10 and causal_pairs(1, 5) == 5
    assert causal_pairs(2, 5) == 4 + 5  # the last two of five positions see 4 and 5 keys
    with pytest.raises(ValueError, match="n_key"):
        causal_pairs(3, 2)


def test_sdpa_is_charged_for_its_causal_pairs_only():
    q = torch.randn(2, 3, 8, 4)
    counts = {}
    for causal in (False, True):
        counter = flop_counter()
        with counter:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal)
        counts[causal] = counter.get_total_flops()
    assert counts[False] == 2 * 2 * 2 * 3 * 8 * 8 * 4  # two products of (8 × 4) @ (4 × 8) per head
    assert counts[True] == counts[False] * causal_pairs(8, 8) // 64


@pytest.mark.parametrize("mask,pairs", [("strict", N * (N - 1) // 2), ("inclusive", N * (N + 1) // 2)])
def test_nrgpt_attention_is_charged_for_the_pairs_of_its_mask(mask, pairs):
    """The strict mask runs as the shifted N−1 stream: N(N−1)/2 pairs per head (full J: d wide)."""
    model = _model(arch="nrgpt", n_steps=1, attention="full", mask=mask)
    idx = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(0))
    counter = flop_counter()
    with counter:
        model(idx, idx)[1].backward()
    sdpa = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "scaled_dot_product" in str(op))
    assert sdpa == 4 * 14 * D * pairs  # 4 heads, 14·d per pair forward + backward


def test_count_does_not_depend_on_the_attention_path():
    """Every energy attention is counted on its SDPA form, whichever path the device would take."""
    model = _model(arch="cem", n_layers=1, interaction="diag_per_head")
    base = training_flops_per_token(model)
    with force_attention_path("scores"):
        assert training_flops_per_token(model) == base
