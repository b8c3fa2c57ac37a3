"""Measured training FLOPs per token (energyformer.models.flops) against hand counts."""
import pytest
import torch

from energyformer.models.flops import training_flops_per_token
from energyformer.models.registry import build_model

V, N, D = 50, 32, 64


def _model(**kw):
    return build_model(dict(vocab_size=V, block_size=N, d_model=D, n_heads=4, **kw))


ATTN = 14 * N * D  # per layer and token: 4·N·d forward (scores, sum) + 10·N·d backward (PyTorch's SDPA count)


def test_gpt_matches_the_hand_count():
    """3 × 2 · (matmul parameters) + per layer the attention products: nanoGPT's 6N + ~12·L·d·N."""
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
