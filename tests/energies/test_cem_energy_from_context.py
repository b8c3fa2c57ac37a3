"""The CEM attention energy from a context (energyformer.energies.cem.interaction_energy_from_context;
docs/inference_compute.md §4): it equals the energy recomputed from ĥ on the whole sequence, for
the last N of S positions (a cache), with and without RoPE, every diagonal kind and diagonal only."""
from __future__ import annotations

import math

import pytest
import torch

from energyformer.energies.cem import interaction_context, interaction_energy, interaction_energy_from_context
from energyformer.energies.heads import rope_cos_sin

DT = torch.float64
D, DH = 12, 6


@pytest.mark.parametrize("n_new", [1, 3, 7])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("diag_kind", ["none", "shared", "per_head", "only"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_energy_from_a_context_equals_the_energy_of_the_whole_sequence(n_new, heads, diag_kind, use_rope):
    if diag_kind == "only" and use_rope:
        pytest.skip("RoPE acts on the low-rank term, which diagonal-only has not")
    gen = torch.Generator().manual_seed(0)
    n = 7
    g, h = (torch.randn(2, n, D, dtype=DT, generator=gen) for _ in range(2))
    w_q, w_k = (torch.randn(heads * DH, D, dtype=DT, generator=gen) / math.sqrt(D) for _ in range(2))
    if diag_kind == "only":
        w_q = w_k = None
    diag = {"none": None, "shared": torch.randn(D, dtype=DT, generator=gen)}.get(
        diag_kind, torch.randn(heads, D, dtype=DT, generator=gen))
    tau = math.sqrt(DH)
    rope = rope_cos_sin(n, DH, 100.0, dtype=DT) if use_rope else None
    whole = interaction_energy(g, h, w_q, w_k, heads, diag=diag, rope=rope, tau=tau)
    ctx = interaction_context(h, w_k, heads, rope=rope)
    torch.testing.assert_close(interaction_energy_from_context(g, ctx, w_q, heads, diag=diag, tau=tau), whole,
                               rtol=0, atol=1e-12)
    # a cache: the context of all n positions, the queries of the last n_new with their RoPE tables
    last = interaction_context(h, w_k, heads, rope=rope)
    last.rope = None if rope is None else tuple(t[n - n_new:] for t in rope)
    got = interaction_energy_from_context(g[:, n - n_new:], last, w_q, heads, diag=diag, tau=tau)
    torch.testing.assert_close(got, whole[:, n - n_new:], rtol=0, atol=1e-12)


def test_energy_from_context_bad_inputs():
    h = torch.randn(1, 3, D, dtype=DT)
    ctx = interaction_context(h, None, 2)
    with pytest.raises(ValueError, match="N <= the context's 3 positions"):
        interaction_energy_from_context(torch.randn(1, 4, D, dtype=DT), ctx, None, 2, diag=torch.ones(D), tau=1.0)
    with pytest.raises(ValueError, match="tau must be given"):
        interaction_energy_from_context(h, ctx, None, 2, diag=torch.ones(D))
