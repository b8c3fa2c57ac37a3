"""NRGPT energy descent (docs/nrgpt.md §5, docs/testing.md §4), over ≥ 500 random draws per setting (float64).

Each setting draws 32 random blocks (weights O(1), γ of random size and sign) × 16 random inputs
= 512 draws, strict mask (the paper's form; with the inclusive mask token 0 attends to itself and
its force is not the gradient of its energy, docs/nrgpt.md §2). Each tensor is drawn from its own
generator, seeded by the draw and the parameter's name, so the draws do not depend on the order
in which the block registers its parameters. For speed the 32 blocks run at once
under ``torch.func.vmap`` through the pure energy functions; ``test_pure_step_equals_block``
holds that vectorized step equal to ``NRGPTBlock.forward``.

With ``E_A = E_AT + s_ff E_FF`` the total energy of token A, what is checked at every step t:

* token 0 (no context): ``E_0(t+1) ≤ E_0(t)`` (Prop 2.1, discrete, small c; a c beyond the
  discrete bound does raise it);
* every token's *own-state* change (its context held at step t) is ≤ 0 — the discrete
  counterpart of the first term of dE_A/dt in docs/nrgpt.md §5;
* the causal cascade: later tokens' energies do rise early (their context moves) and those rises
  die out: the largest rise in the last quarter of the run is < 5 % of the largest change in the
  first quarter (for 99 % of draws and tokens: the slowest draws converge later). Strict
  monotonicity from a fixed step on is NOT reached within a few hundred steps: with a
  normalized ``g`` the radial part of the force is never damped, so ‖x‖ grows linearly and the
  effective step ``c/s(x)`` decays like 1/t (slow, power-law convergence);
* a random (unconstrained) η does increase energies; ``psd_plus_skew`` without a norm
  (Prop 2.2) descends.
"""
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from energyformer.energies import nrgpt as E
from energyformer.layers.nrgpt import NRGPTBlock

D, H, N, M = 8, 2, 3, 16
SEEDS, BATCH = 32, 16
SEED_BASE = 0  # draws use seeds SEED_BASE ... SEED_BASE + SEEDS - 1


def generator(seed, name):
    """The generator of one named tensor of draw ``seed``: each parameter is drawn from its own
    stream, so the draws do not depend on the order in which the block lists its parameters."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def draw_param(name, shape, c, gen):
    """A random value for the block parameter ``name`` (float64), chosen by its name."""
    kw = dict(generator=gen, dtype=torch.float64)
    if name in ("attention.alpha", "ff_scale"):
        return 0.5 + torch.rand(shape, **kw)
    if name == "norm.weight":  # γ: random size and sign, so diag(γ) matters
        sign = torch.where(torch.rand(shape, **kw) < 0.5, -1.0, 1.0)
        return sign * (0.5 + torch.rand(shape, **kw))
    if name == "eta.L":  # η₊ = L Lᵀ ≈ c·I, well conditioned (discrete steps need λ_min(η₊) ≫ ‖S−Sᵀ‖²)
        return math.sqrt(c) * (torch.eye(D, dtype=torch.float64) + 0.3 * torch.randn(shape, **kw) / math.sqrt(D))
    if name == "eta.S":
        return 0.5 * c * torch.randn(shape, **kw) / math.sqrt(D)
    fan_in = shape[-1] if len(shape) > 1 else 4  # weights O(1): J, the FF matrices, biases, LayerNorm's δ
    return torch.randn(shape, **kw) / math.sqrt(fan_in)


def draw_block(seed, eta_param, norm, c):
    blk = NRGPTBlock(D, H, eta_param=eta_param, norm=norm, c_init=c, d_ff=M, mask="strict").double()
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if name != "eta.c_raw":  # c_diag_gamma's c is the c_init given
                p.copy_(draw_param(name, p.shape, c, generator(seed, name)))
    x = torch.randn(BATCH, N, D, generator=generator(seed, "x"), dtype=torch.float64)
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
    pairs = [draw_block(SEED_BASE + s, eta_param, norm, c) for s in range(seeds)]
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
    force = E.attention_grad_reference(g, p["J"], p["alpha"], 1.0, True) + p["s"] * E.ff2w_grad(
        g, p["W1"], p["b1"], p["W2"], p["b2"])
    return x - force @ p["eta"].T


def energy(p, x, x_context):
    """Total per-token energy at ``x``; the attention keys come from ``x_context``."""
    g, ctx = normalize(p, x), normalize(p, x_context)
    return (E.attention_energy(g, p["J"], p["alpha"], 1.0, True, context=ctx)
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


def descent_failures(Es, own):
    """Share of the draws (block × input) in which some step raised token 0's energy or some
    token's own-state energy (the two guarantees of docs/nrgpt.md §5)."""
    dE = Es[1:] - Es[:-1]
    bad = (dE[..., 0].amax(0) > tol(Es)) | (own.amax(dim=0).amax(dim=-1) > tol(Es))
    return bad.float().mean().item()


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_c_diag_gamma_descends(norm):
    """c = 0.01, far below the discrete bound (c times a Lipschitz constant of the force < 2) for
    every draw: no step of any draw raises token 0's energy or a token's own-state energy."""
    P, X, _ = draw("c_diag_gamma", norm, 0.01)
    Es, own = run(P, X, 40)
    dE = Es[1:] - Es[:-1]
    assert dE[..., 0].max() <= tol(Es), "token 0 energy increased"
    assert own.max() <= tol(Es), "an own-state step increased a token's energy"
    assert (dE[..., 0].amin(0) < -1e-6).float().mean() > 0.99  # token 0 really moves in (almost) every draw


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_c_diag_gamma_causal_cascade(norm):
    """c = 0.2 over 160 steps: later tokens' energies rise at first (their context moves) and the
    rises die out. A step of 0.2 is close to the bound for the steepest random blocks: about one
    draw in 5,000 raised an energy (3 of 17,000 measured). So descent is required of 99.5 % of the draws
    (test_a_step_beyond_the_bound_fails_descent shows that check failing), and the cascade of
    99 % of (draw, token) pairs: the largest rise in the last quarter of the run is < 5 % of the
    largest change in the first quarter (measured: at most 1.2 %; the slowest 1 % up to 17 %)."""
    T = 160
    P, X, _ = draw("c_diag_gamma", norm, 0.2)
    Es, own = run(P, X, T)
    assert descent_failures(Es, own) <= 0.005
    dE = Es[1:] - Es[:-1]
    q = T // 4
    early = dE[:q, ..., 1:].abs().amax(0)
    assert (dE[:q, ..., 1:] > 1e-4).any(dim=0).float().mean() > 0.2, "later tokens should rise at first"
    ratio = dE[-q:, ..., 1:].clamp(min=0).amax(0) / early
    worst = float(ratio.quantile(0.99))
    assert worst < 0.05, f"cascade transient did not die out (99th percentile of the ratio {worst:.3g})"


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_a_step_beyond_the_bound_fails_descent(norm):
    """The descent checks can fail: with c = 4 (beyond the bound for many random blocks) energies
    rise in far more than the 0.5 % of draws the cascade test allows."""
    P, X, _ = draw("c_diag_gamma", norm, 4.0)
    Es, own = run(P, X, 20)
    assert descent_failures(Es, own) > 0.02


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
