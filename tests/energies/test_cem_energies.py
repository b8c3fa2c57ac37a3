"""CEM energies (energyformer/energies/cem.py, silu_antiderivative.py, rope.py): docs/cem.md §2–§4,
docs/testing.md §1, §7, §11, §12.

Every analytic gradient is held against torch.autograd on its own energy (float64, atol 1e-10,
B=2, N in {1, 7, 33}, heads in {1, 4}); every fast path against its plain per-element reference.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from energyformer.energies.cem import (
    gate_tie_context,
    gate_tie_energy,
    gate_tie_grad,
    interaction_context,
    interaction_energy,
    interaction_energy_reference,
    interaction_grad,
    interaction_grad_reference,
    rms_norm_vjp,
    up_tie_context,
    up_tie_energy,
    up_tie_grad,
)
from energyformer.energies.heads import apply_rope, rope_cos_sin, rope_matrices
from energyformer.energies.silu_antiderivative import dilog, dilog_neg_exp, silu_antiderivative

DT = torch.float64
ATOL = 1e-10
D = 12
DH = 6


def _data(n, heads, seed=0, d=D, dh=DH):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(2, n, d, dtype=DT, generator=gen)
    h = torch.randn(2, n, d, dtype=DT, generator=gen)
    w_q = torch.randn(heads * dh, d, dtype=DT, generator=gen) / math.sqrt(d)
    w_k = torch.randn(heads * dh, d, dtype=DT, generator=gen) / math.sqrt(d)
    return g, h, w_q, w_k, gen


def _diag(kind, heads, gen, d=D):
    if kind == "none":
        return None
    if kind == "shared":
        return torch.randn(d, dtype=DT, generator=gen) * 0.5
    return torch.randn(heads, d, dtype=DT, generator=gen) * 0.5


def _autograd(energy_fn, g):
    g = g.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(energy_fn(g).sum(), g)
    return grad


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("diag_kind", ["none", "shared", "per_head"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_interaction_grad_matches_autograd_and_reference(n, heads, diag_kind, use_rope):
    g, h, w_q, w_k, gen = _data(n, heads)
    diag = _diag(diag_kind, heads, gen)
    rope = rope_cos_sin(n, DH, 100.0, dtype=DT) if use_rope else None
    kw = dict(diag=diag, rope=rope)
    auto = _autograd(lambda x: interaction_energy(x, h, w_q, w_k, heads, **kw), g)
    fast = interaction_grad(g, h, w_q, w_k, heads, **kw)
    assert fast.shape == g.shape
    torch.testing.assert_close(fast, auto, atol=ATOL, rtol=0)
    if n <= 7:  # the O(H N² d²) reference at the small sizes
        torch.testing.assert_close(interaction_grad_reference(g, h, w_q, w_k, heads, **kw), fast, atol=ATOL, rtol=0)
        e_ref = interaction_energy_reference(g, h, w_q, w_k, heads, **kw)
        torch.testing.assert_close(interaction_energy(g, h, w_q, w_k, heads, **kw), e_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("heads", [1, 4])
def test_diag_only_grad_matches_autograd_and_reference(n, heads):
    g, h, _, _, gen = _data(n, heads)
    diag = torch.randn(heads, D, dtype=DT, generator=gen)
    kw = dict(diag=diag, tau=math.sqrt(DH))
    auto = _autograd(lambda x: interaction_energy(x, h, None, None, heads, **kw), g)
    fast = interaction_grad(g, h, None, None, heads, **kw)
    torch.testing.assert_close(fast, auto, atol=ATOL, rtol=0)
    if n <= 7:
        torch.testing.assert_close(interaction_grad_reference(g, h, None, None, heads, **kw), fast, atol=ATOL, rtol=0)


@pytest.mark.parametrize("diag_kind", ["none", "shared", "per_head"])
def test_llama_rope_mode_matches_reference_and_differs_from_exact(diag_kind):
    n, heads = 7, 4
    g, h, w_q, w_k, gen = _data(n, heads, seed=3)
    diag = _diag(diag_kind, heads, gen)
    rope = rope_cos_sin(n, DH, 100.0, dtype=DT)
    llama = interaction_grad(g, h, w_q, w_k, heads, diag=diag, rope=rope, exact_rope=False)
    ref = interaction_grad_reference(g, h, w_q, w_k, heads, diag=diag, rope=rope, exact_rope=False)
    torch.testing.assert_close(llama, ref, atol=ATOL, rtol=0)
    exact = interaction_grad(g, h, w_q, w_k, heads, diag=diag, rope=rope, exact_rope=True)
    assert (exact - llama)[:, 1:].abs().max() > 1e-3  # position 0 has R_0 = I, so they agree there
    torch.testing.assert_close(exact[:, 0], llama[:, 0], atol=ATOL, rtol=0)


def test_one_step_is_sdpa_with_values_equal_keys_then_wq():
    """docs/testing.md §2: −∇ε = scaled_dot_product_attention(q, k, k, is_causal=True) @ W_Q (no RoPE, no diagonal)."""
    n, heads = 33, 4
    g, h, w_q, w_k, _ = _data(n, heads, seed=1)
    q = (g @ w_q.t()).view(2, n, heads, DH).transpose(1, 2)
    k = (h @ w_k.t()).view(2, n, heads, DH).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, k, is_causal=True)  # default scale 1/sqrt(d_h)
    expected = y.transpose(1, 2).reshape(2, n, heads * DH) @ w_q
    torch.testing.assert_close(-interaction_grad(g, h, w_q, w_k, heads), expected, atol=ATOL, rtol=0)


def test_shared_diag_equals_per_head_diagonals_set_equal():
    n, heads = 33, 4
    g, h, w_q, w_k, gen = _data(n, heads, seed=2)
    d = torch.randn(D, dtype=DT, generator=gen)
    rope = rope_cos_sin(n, DH, dtype=DT)
    for exact in (True, False):
        shared = interaction_grad(g, h, w_q, w_k, heads, diag=d, rope=rope, exact_rope=exact)
        per_head = interaction_grad(g, h, w_q, w_k, heads, diag=d.expand(heads, D).clone(), rope=rope,
                                    exact_rope=exact)
        torch.testing.assert_close(shared, per_head, atol=ATOL, rtol=0)
    torch.testing.assert_close(interaction_energy(g, h, w_q, w_k, heads, diag=d),
                               interaction_energy(g, h, w_q, w_k, heads, diag=d.expand(heads, D)), atol=ATOL, rtol=0)


def test_zero_diagonal_reproduces_tied_attention():
    n, heads = 7, 4
    g, h, w_q, w_k, _ = _data(n, heads, seed=4)
    plain = interaction_grad(g, h, w_q, w_k, heads)
    for diag in (torch.zeros(D, dtype=DT), torch.zeros(heads, D, dtype=DT)):
        torch.testing.assert_close(interaction_grad(g, h, w_q, w_k, heads, diag=diag), plain, atol=ATOL, rtol=0)


def test_temperature_is_sqrt_head_dim_even_for_augmented_heads():
    """docs/testing.md §11: the D+LR augmented heads use scale 1/sqrt(d_h), not SDPA's default 1/sqrt(d_h + d)."""
    n, heads = 7, 4
    g, h, w_q, w_k, gen = _data(n, heads, seed=5)
    diag = torch.randn(heads, D, dtype=DT, generator=gen)
    default = interaction_grad(g, h, w_q, w_k, heads, diag=diag)
    torch.testing.assert_close(default, interaction_grad(g, h, w_q, w_k, heads, diag=diag, tau=math.sqrt(DH)),
                               atol=ATOL, rtol=0)
    wrong = interaction_grad(g, h, w_q, w_k, heads, diag=diag, tau=math.sqrt(DH + D))
    assert (wrong - default).abs().max() > 1e-3
    # The τ prefactor: the energy −τ·lse(s/τ) has exactly the scale of attention (τ-independent update form);
    # without the prefactor the gradient is 1/τ times smaller.
    def e_no_prefactor(x):
        return interaction_energy(x, h, w_q, w_k, heads, diag=diag) / math.sqrt(DH)

    torch.testing.assert_close(_autograd(e_no_prefactor, g) * math.sqrt(DH), default, atol=ATOL, rtol=0)


def test_energy_is_causal_prefix_truncation():
    """docs/testing.md §3: ε_i computed from the prefix 1..i equals the full-sequence value."""
    n, heads = 9, 4
    g, h, w_q, w_k, gen = _data(n, heads, seed=6)
    diag = torch.randn(D, dtype=DT, generator=gen)
    full_e = interaction_energy(g, h, w_q, w_k, heads, diag=diag, rope=rope_cos_sin(n, DH, dtype=DT))
    full_g = interaction_grad(g, h, w_q, w_k, heads, diag=diag, rope=rope_cos_sin(n, DH, dtype=DT))
    for m in (1, 4, 8):
        r = rope_cos_sin(m, DH, dtype=DT)
        torch.testing.assert_close(interaction_energy(g[:, :m], h[:, :m], w_q, w_k, heads, diag=diag, rope=r),
                                   full_e[:, :m], atol=ATOL, rtol=0)
        torch.testing.assert_close(interaction_grad(g[:, :m], h[:, :m], w_q, w_k, heads, diag=diag, rope=r),
                                   full_g[:, :m], atol=ATOL, rtol=0)


def test_precomputed_context_is_reused():
    n, heads = 7, 4
    g, h, w_q, w_k, gen = _data(n, heads, seed=7)
    rope = rope_cos_sin(n, DH, dtype=DT)
    ctx = interaction_context(h, w_k, heads, rope=rope, exact_rope=True)
    torch.testing.assert_close(interaction_grad(g, h, w_q, w_k, heads, rope=rope, context=ctx),
                               interaction_grad(g, h, w_q, w_k, heads, rope=rope), atol=ATOL, rtol=0)


def test_interaction_bad_inputs_raise():
    g, h, w_q, w_k, _ = _data(5, 2)
    with pytest.raises(ValueError, match="rope"):
        interaction_grad(g, h, w_q, w_k, 2, rope=rope_cos_sin(4, DH, dtype=DT))
    with pytest.raises(ValueError, match="diag"):
        interaction_grad(g, h, w_q, w_k, 2, diag=torch.zeros(3, D, dtype=DT))
    with pytest.raises(ValueError, match="w_q"):
        interaction_grad(g, h, w_q[:, :5], w_k, 2)
    with pytest.raises(ValueError, match="tau"):
        interaction_grad(g, h, None, None, 2, diag=torch.zeros(2, D, dtype=DT))
    with pytest.raises(ValueError, match="h_ctx"):
        interaction_energy(g, h[:, :3], w_q, w_k, 2)


# ----------------------------------------------------------------------------- RoPE

def test_rope_matches_explicit_rotation_matrices_and_inverse():
    cos, sin = rope_cos_sin(9, 8, 50.0, dtype=DT)
    x = torch.randn(2, 3, 9, 8, dtype=DT)
    r = rope_matrices(cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), torch.einsum("nab,zhnb->zhna", r, x), atol=1e-12, rtol=0)
    torch.testing.assert_close(apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(8, dtype=DT).expand(9, 8, 8), atol=1e-12, rtol=0)


def test_rope_odd_head_dim_raises():
    with pytest.raises(ValueError, match="head_dim=5"):
        rope_cos_sin(4, 5)


# ----------------------------------------------------------------------------- SiLU antiderivative

def test_silu_antiderivative_value_at_zero():
    assert abs(float(silu_antiderivative(torch.zeros(1, dtype=DT))) + math.pi ** 2 / 12) < 1e-15


def test_silu_antiderivative_derivative_is_silu():
    z = torch.linspace(-40.0, 40.0, 4001, dtype=DT)
    auto = _autograd(silu_antiderivative, z)
    torch.testing.assert_close(auto, F.silu(z), atol=1e-12, rtol=0)
    h = 1e-5  # central finite differences
    fd = (silu_antiderivative(z + h) - silu_antiderivative(z - h)) / (2 * h)
    torch.testing.assert_close(fd, F.silu(z), atol=1e-8, rtol=1e-7)  # F ~ z²/2: rounding grows with |z|


def test_silu_antiderivative_matches_quadrature():
    z = torch.tensor([-7.0, -1.3, 0.4, 2.0, 9.5], dtype=DT)
    for zi in z:
        t = torch.linspace(0.0, float(zi), 20001, dtype=DT)
        quad = torch.trapezoid(F.silu(t), t) - math.pi ** 2 / 12
        assert abs(float(silu_antiderivative(zi.reshape(1))) - float(quad)) < 1e-7


def test_dilog_against_mpmath_and_identities():
    mpmath = pytest.importorskip("mpmath")
    xs = [0.0, -1e-9, -0.01, -0.3, -0.5, -0.999, -1.0, -1.001, -2.5, -17.0, -1e3, -1e8]
    got = dilog(torch.tensor(xs, dtype=DT))
    for x, v in zip(xs, got.tolist()):
        exact = float(mpmath.polylog(2, x))
        assert abs(v - exact) <= 1e-13 * max(1.0, abs(exact)), (x, v, exact)
    assert abs(float(dilog(torch.tensor([-1.0], dtype=DT))) + math.pi ** 2 / 12) < 1e-14
    # Li₂(−e^z) stays finite for huge |z| (no e^z is formed)
    big = dilog_neg_exp(torch.tensor([-800.0, 800.0], dtype=DT))
    assert torch.isfinite(big).all() and abs(float(big[0])) < 1e-300
    with pytest.raises(ValueError, match="x <= 0"):
        dilog(torch.tensor([0.5], dtype=DT))


# ----------------------------------------------------------------------------- gated MLP

TIES = {"gate": (gate_tie_context, gate_tie_energy, gate_tie_grad), "up": (up_tie_context, up_tie_energy, up_tie_grad)}


def gated_mlp_context(h, w_gate, w_up, tie):
    return TIES[tie][0](h, w_gate, w_up)


def gated_mlp_energy(g, h, w_gate, w_up, tie):
    return TIES[tie][1](g, h, w_gate, w_up)


def gated_mlp_grad(g, h, w_gate, w_up, tie="gate", context=None):
    return TIES[tie][2](g, h, w_gate, w_up, context=context)

@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("tie", ["gate", "up"])
def test_gated_mlp_grad_matches_autograd(n, tie):
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(2, n, D, dtype=DT, generator=gen)
    h = torch.randn(2, n, D, dtype=DT, generator=gen)
    w_gate = torch.randn(20, D, dtype=DT, generator=gen) / math.sqrt(D)
    w_up = torch.randn(20, D, dtype=DT, generator=gen) / math.sqrt(D)
    auto = _autograd(lambda x: gated_mlp_energy(x, h, w_gate, w_up, tie), g)
    fast = gated_mlp_grad(g, h, w_gate, w_up, tie)
    torch.testing.assert_close(fast, auto, atol=ATOL, rtol=0)
    ctx = gated_mlp_context(h, w_gate, w_up, tie)
    torch.testing.assert_close(gated_mlp_grad(g, h, w_gate, w_up, tie, context=ctx), fast, atol=ATOL, rtol=0)
    assert gated_mlp_energy(g, h, w_gate, w_up, tie).shape == (2, n)


@pytest.mark.parametrize("tie", ["gate", "up"])
def test_gated_mlp_one_step_is_swiglu(tie):
    """docs/testing.md §2: at g = ĥ, −∇ε = SwiGLU with down = gateᵀ (variant A) or down = upᵀ (variant B)."""
    gen = torch.Generator().manual_seed(11)
    h = torch.randn(2, 7, D, dtype=DT, generator=gen)
    w_gate = torch.randn(20, D, dtype=DT, generator=gen)
    w_up = torch.randn(20, D, dtype=DT, generator=gen)
    w_down = (w_gate if tie == "gate" else w_up).t()
    swiglu = (F.silu(h @ w_gate.t()) * (h @ w_up.t())) @ w_down.t()
    torch.testing.assert_close(-gated_mlp_grad(h, h, w_gate, w_up, tie), swiglu, atol=ATOL, rtol=0)


def test_gated_mlp_variants_differ_off_the_first_step():
    gen = torch.Generator().manual_seed(12)
    g, h = torch.randn(2, 5, D, dtype=DT, generator=gen), torch.randn(2, 5, D, dtype=DT, generator=gen)
    w_gate, w_up = torch.randn(20, D, dtype=DT, generator=gen), torch.randn(20, D, dtype=DT, generator=gen)
    a, b = gated_mlp_grad(g, h, w_gate, w_up, "gate"), gated_mlp_grad(g, h, w_gate, w_up, "up")
    assert (a - b).abs().max() > 1e-3


def test_gated_mlp_bad_inputs_raise():
    g = torch.randn(2, 5, D, dtype=DT)
    with pytest.raises(ValueError, match="h_ctx"):
        gated_mlp_grad(g, g[:, :3], torch.randn(8, D, dtype=DT), torch.randn(8, D, dtype=DT), "up")
    with pytest.raises(ValueError, match="w_gate"):
        gated_mlp_grad(g, g, torch.randn(8, D, dtype=DT), torch.randn(9, D, dtype=DT))


# ----------------------------------------------------------------------------- norm Jacobian

def test_rms_norm_vjp_matches_autograd():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 7, D, dtype=DT, generator=gen)
    v = torch.randn(2, 7, D, dtype=DT, generator=gen)
    w = torch.randn(D, dtype=DT, generator=gen)
    eps = 1e-5
    xr = x.clone().requires_grad_(True)
    y = w * xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + eps)
    (auto,) = torch.autograd.grad((y * v).sum(), xr)
    torch.testing.assert_close(rms_norm_vjp(x, v, w, eps), auto, atol=ATOL, rtol=0)
