"""NRGPT energy descent (docs/nrgpt.md §5, docs/testing.md §4), over ≥ 500 random draws per setting (float64).

Each setting draws 32 random blocks (weights O(1), γ of random size and sign) × 16 random inputs
= 512 draws, strict mask (the paper's form; with the inclusive mask token 0 attends to itself and
its force is not the gradient of its energy, docs/nrgpt.md §2). For speed the 32 blocks run at once
under ``torch.func.vmap`` through the pure energy functions; ``test_pure_step_equals_block``
holds that vectorized step equal to ``NRGPTBlock.forward``.

With ``E_A = E_AT + s_ff E_FF`` the total energy of token A, what is checked at every step t:

* token 0 (no context): ``E_0(t+1) ≤ E_0(t)`` (Prop 2.1, discrete, small c);
* every token's *own-state* change (its context held at step t) is ≤ 0 — the discrete
  counterpart of the first term of dE_A/dt in docs/nrgpt.md §5;
* the causal cascade: later tokens' energies do rise early (their context moves) and those rises
  die out: the largest rise in the last quarter of the run is < 5 % of the largest change in the
  first quarter. Strict monotonicity from a fixed step on is NOT reached within a few hundred
  steps: with a normalized ``g`` the radial part of the force is never damped, so ‖x‖ grows
  linearly and the effective step ``c/s(x)`` decays like 1/t (slow, power-law convergence);
* a random (unconstrained) η does increase energies; ``psd_plus_skew`` without a norm
  (Prop 2.2) descends.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from energyformer.energies import nrgpt as E
from energyformer.layers.nrgpt import NRGPTBlock

D, H, N, M = 8, 2, 3, 16
SEEDS, BATCH = 32, 16




# Parameter order of the draws (the generator is consumed in this order): the block's own tensors
# (J, α, s_ff, η's c_raw or L, S) first, then the norm, the FF weights and η's Linear — the order
# the draws were calibrated with, kept fixed now that J, α and η live in sub-modules.
DRAW_FIRST = ("attention.J", "attention.alpha", "ff_scale", "eta.c_raw", "eta.L", "eta.S")


def draw_order(blk):
    params = dict(blk.named_parameters())
    names = [n for n in DRAW_FIRST if n in params] + [n for n in params if n not in DRAW_FIRST]
    return [(n, params[n]) for n in names]


def draw_block(seed, eta_param, norm, c):
    blk = NRGPTBlock(D, H, eta_param=eta_param, norm=norm, c_init=c, d_ff=M, mask="strict").double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draw_order(blk):
            if name == "eta.c_raw":
                continue
            if name in ("attention.alpha", "ff_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
            elif name == "norm.weight":  # γ: random size and sign, so diag(γ) matters
                sign = torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0).to(p.dtype)
                p.copy_(sign * (0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype)))
            elif name == "eta.L":  # η₊ = L Lᵀ ≈ c·I, well conditioned (discrete steps need λ_min(η₊) ≫ ‖S−Sᵀ‖²)
                noise = 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(D)
                p.copy_(math.sqrt(c) * (torch.eye(D, dtype=p.dtype) + noise))
            elif name == "eta.S":
                p.copy_(0.5 * c * torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(D))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(fan_in))
    x = torch.randn(BATCH, N, D, generator=gen, dtype=torch.float64)
    return blk, x


def block_params(blk):
    """The block's parameters as plain tensors (η as a dense matrix), for the vectorized step."""
    W1, b1, W2, b2 = (p.detach() for p in blk.ff.weights())
    p = dict(J=blk.attention.J.detach(), alpha=blk.alpha.detach(), s=blk.ff_scale.detach(),
             W1=W1, b1=b1, W2=W2, b2=b2, eta=blk.eta_matrix().detach())
    if blk.norm is not None:
        p["gamma"] = blk.norm.weight.detach()
        if blk.norm_kind == "layernorm":
            p["delta"] = blk.norm.bias.detach()
    return p


def draw(eta_param, norm, c, seeds=SEEDS):
    pairs = [draw_block(s, eta_param, norm, c) for s in range(seeds)]
    params = [block_params(b) for b, _ in pairs]
    stacked = {k: torch.stack([p[k] for p in params]) for k in params[0]}
    return stacked, torch.stack([x for _, x in pairs]), pairs


def normalize(p, x):
    if "delta" in p:
        return F.layer_norm(x, (D,), p["gamma"], p["delta"], 1e-5)
    if "gamma" in p:
        return p["gamma"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x


def step(p, x):
    g = normalize(p, x)
    force = E.attention_grad_naive(g, p["J"], p["alpha"], 1.0, "strict") + p["s"] * E.ff2w_grad(
        g, p["W1"], p["b1"], p["W2"], p["b2"])
    return x - force @ p["eta"].T


def energy(p, x, x_context):
    """Total per-token energy at ``x``; the attention keys come from ``x_context``."""
    g, ctx = normalize(p, x), normalize(p, x_context)
    return (E.attention_energy(g, p["J"], p["alpha"], 1.0, "strict", context=ctx)
            + p["s"] * E.ff2w_energy(g, p["W1"], p["b1"], p["W2"], p["b2"]))


@torch.no_grad()
def run(P, X, T):
    """Energies (T+1, S, B, N) and own-state energy changes (T, S, B, N) for all draws at once."""
    vstep, venergy = vmap(step), vmap(energy)
    energies, own = [venergy(P, X, X)], []
    for _ in range(T):
        X_new = vstep(P, X)
        own.append(venergy(P, X_new, X) - energies[-1])
        energies.append(venergy(P, X_new, X_new))
        X = X_new
    Es = torch.stack(energies)
    assert torch.isfinite(Es).all()
    return Es, torch.stack(own)


def tol(Es):
    return 1e-12 * (1 + Es.abs().max())


@pytest.mark.parametrize("eta_param,norm", [("c_diag_gamma", "layernorm"), ("c_diag_gamma", "rmsnorm"),
                                            ("full", "layernorm"), ("psd_plus_skew", None)])
def test_pure_step_equals_block(eta_param, norm):
    P, X, pairs = draw(eta_param, norm, 0.1, seeds=2)
    blk, x = pairs[1]
    with torch.no_grad():
        p1 = {k: v[1] for k, v in P.items()}
        torch.testing.assert_close(vmap(step)(P, X)[1], blk(x), atol=1e-12, rtol=0)
        e = blk.energy(x)
        torch.testing.assert_close(energy(p1, x, x), e["attn"] + e["ff"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("c,T", [(0.01, 40), (0.2, 160)])
def test_c_diag_gamma_descends(norm, c, T):
    P, X, _ = draw("c_diag_gamma", norm, c)
    Es, own = run(P, X, T)
    dE = Es[1:] - Es[:-1]
    assert dE[..., 0].max() <= tol(Es), "token 0 energy increased"
    assert own.max() <= tol(Es), "an own-state step increased a token's energy"
    assert (dE[..., 0].amin(0) < -1e-6).float().mean() > 0.99  # token 0 really moves in (almost) every draw
    if c == 0.2:  # the causal cascade
        q = T // 4
        early = dE[:q, ..., 1:].abs().amax(0)
        assert (dE[:q, ..., 1:] > 1e-4).any(dim=0).float().mean() > 0.2, "later tokens should rise at first"
        ratio = dE[-q:, ..., 1:].clamp(min=0).amax(0) / early
        assert ratio.max() < 0.05, f"cascade transient did not die out (worst ratio {float(ratio.max()):.3g})"


def test_random_eta_can_increase_energy():
    P, X, _ = draw("full", "layernorm", 0.1)
    gen = torch.Generator().manual_seed(123)
    P["eta"] = 0.5 * torch.randn(P["eta"].shape, generator=gen, dtype=torch.float64) / math.sqrt(D)
    Es, own = run(P, X, 20)
    dE = Es[1:] - Es[:-1]
    assert (dE[..., 0].amax(0) > 1e-3).any(dim=-1).float().mean() > 0.5  # most random η raise token 0's energy
    assert (own.amax(0) > 1e-3).any(dim=(-1, -2)).float().mean() > 0.5


def test_psd_plus_skew_without_norm_descends():
    """docs/nrgpt.md §5 Prop 2.2: g = x and η = L Lᵀ + (S − Sᵀ); small steps never raise a token's own energy."""
    P, X, _ = draw("psd_plus_skew", None, 0.01)
    eta = P["eta"]
    assert torch.linalg.eigvalsh((eta + eta.transpose(1, 2)) / 2).min() >= -1e-12
    assert (eta - eta.transpose(1, 2)).abs().amax() > 2e-3  # the skew part is really there
    Es, own = run(P, X, 30)
    dE = Es[1:] - Es[:-1]
    assert dE[..., 0].max() <= tol(Es), "token 0 energy increased"
    assert own.max() <= tol(Es), "an own-state step increased a token's energy"
    assert (dE[..., 0].amin(0) < -1e-6).float().mean() > 0.99
