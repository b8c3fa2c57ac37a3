"""NRGPT energies (docs/nrgpt.md §2, §3, docs/testing.md §1): analytic partial gradients == torch.autograd, float64."""
import math

import pytest
import torch
import torch.nn.functional as F

from energyformer.energies import nrgpt as E
from energyformer.energies.heads import causal_mask

D = 8
ATOL = 1e-10




def _attn_params(kind, H, seed=0, d=D):
    gen = torch.Generator().manual_seed(seed)
    alpha = 0.5 + torch.rand(H, generator=gen, dtype=torch.float64)  # not all ones: α must enter
    if kind == "full":
        J = 0.4 * torch.randn(H, d, d, generator=gen, dtype=torch.float64)
        return dict(J=J), alpha
    dh = 4
    qw = 0.6 * torch.randn(H, dh, d, generator=gen, dtype=torch.float64)
    kw = 0.6 * torch.randn(H, dh, d, generator=gen, dtype=torch.float64)
    return dict(q_weight=qw, k_weight=kw), alpha


def _energy(kind, g, w, alpha, beta, mask, context=None):
    if kind == "full":
        return E.attention_energy(g, w["J"], alpha, beta, mask == "strict", context=context)
    return E.attention_energy_factored(g, w["q_weight"], w["k_weight"], alpha, beta, mask == "strict", context=context)


def _grads(kind, g, w, alpha, beta, mask):
    if kind == "full":
        return (E.attention_grad(g, w["J"], alpha, beta, mask == "strict"),
                E.attention_grad_reference(g, w["J"], alpha, beta, mask == "strict"))
    return (E.attention_grad_factored(g, w["q_weight"], w["k_weight"], alpha, beta, mask == "strict"),
            E.attention_grad_factored_reference(g, w["q_weight"], w["k_weight"], alpha, beta, mask == "strict"))


def _autograd_partial(kind, g, w, alpha, beta, mask):
    """∂E_A/∂g_A with the keys (context) detached: autograd on the energy function itself."""
    gq = g.detach().clone().requires_grad_(True)
    e = _energy(kind, gq, w, alpha, beta, mask, context=g.detach())
    (grad,) = torch.autograd.grad(e.sum(), gq)
    return grad, e


@pytest.mark.parametrize("kind", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.parametrize("N", [1, 7, 33])
def test_attention_grad_matches_autograd(kind, mask, H, N):
    torch.manual_seed(N + 10 * H)
    g = torch.randn(2, N, D, dtype=torch.float64)
    w, alpha = _attn_params(kind, H, seed=N * H)
    beta = 0.7
    ref, e = _autograd_partial(kind, g, w, alpha, beta, mask)
    fast, reference = _grads(kind, g, w, alpha, beta, mask)
    assert e.shape == (2, N) and fast.shape == (2, N, D)
    torch.testing.assert_close(reference, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    assert ref.abs().max() > 1e-3 or (mask == "strict" and N == 1)  # the check is not vacuous


@pytest.mark.parametrize("kind", ["full", "factored"])
@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.parametrize("N", [7, 33])
def test_strict_force_is_per_token_partial_gradient(kind, H, N):
    """Strict mask, no context trick: loop over A, token A requires grad, all others detached."""
    torch.manual_seed(3)
    g = torch.randn(2, N, D, dtype=torch.float64)
    w, alpha = _attn_params(kind, H, seed=1)
    fast, _ = _grads(kind, g, w, alpha, 1.3, "strict")
    for A in range(N):
        gA = g[:, A].clone().requires_grad_(True)
        gg = torch.cat([g[:, :A], gA[:, None], g[:, A + 1:]], dim=1)
        e = _energy(kind, gg, w, alpha, 1.3, "strict")[:, A]
        (ref,) = torch.autograd.grad(e.sum(), gA)
        torch.testing.assert_close(fast[:, A], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("H", [1, 4])
def test_inclusive_force_omits_exactly_the_self_key_term(H):
    """docs/nrgpt.md §2 item 3: autograd through both slots of g_A = force − Σ_h α_h p^h_AA J_h g_A."""
    torch.manual_seed(5)
    N = 7
    g = torch.randn(2, N, D, dtype=torch.float64)
    w, alpha = _attn_params("full", H, seed=2)
    J, beta = w["J"], 0.9
    force = E.attention_grad(g, J, alpha, beta, False)
    # s[b, h, A, B] = g_Bᵀ J_h g_A
    scores = beta * torch.einsum("bkd,hde,bae->bhak", g, J, g)
    p = scores.masked_fill(~causal_mask(N, N), float("-inf")).softmax(-1)
    p_self = torch.diagonal(p, dim1=-2, dim2=-1)  # (B, H, N)
    self_term = torch.einsum("h,bha,hde,bae->bad", alpha, p_self, J, g)  # α_h p_AA J_h g_A
    for A in range(N):
        gA = g[:, A].clone().requires_grad_(True)
        gg = torch.cat([g[:, :A], gA[:, None], g[:, A + 1:]], dim=1)
        (full,) = torch.autograd.grad(E.attention_energy(gg, J, alpha, beta, False)[:, A].sum(), gA)
        torch.testing.assert_close(full, force[:, A] - self_term[:, A], atol=ATOL, rtol=0)
    assert self_term.abs().max() > 1e-3


@pytest.mark.parametrize("mask", ["strict", "inclusive"])
@pytest.mark.parametrize("H", [1, 4])
def test_factored_equals_full_with_J_from_factors(mask, H):
    torch.manual_seed(7)
    g = torch.randn(2, 7, D, dtype=torch.float64)
    w, alpha = _attn_params("factored", H, seed=4)
    J = w["k_weight"].transpose(1, 2) @ w["q_weight"]  # J_h = W^Kᵀ W^Q
    torch.testing.assert_close(_energy("factored", g, w, alpha, 0.5, mask),
                               E.attention_energy(g, J, alpha, 0.5, mask == "strict"), atol=ATOL, rtol=0)
    torch.testing.assert_close(_grads("factored", g, w, alpha, 0.5, mask)[0],
                               E.attention_grad(g, J, alpha, 0.5, mask == "strict"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["full", "factored"])
def test_strict_first_token_zero_energy_zero_force_finite_backward(kind):
    g = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    w, alpha = _attn_params(kind, 4)
    e = _energy(kind, g, w, alpha, 1.0, "strict")
    fast, reference = _grads(kind, g, w, alpha, 1.0, "strict")
    assert torch.equal(e[:, 0], torch.zeros(2, dtype=torch.float64))
    assert torch.equal(fast[:, 0], torch.zeros(2, D, dtype=torch.float64))
    assert torch.equal(reference[:, 0], torch.zeros(2, D, dtype=torch.float64))
    (ge,) = torch.autograd.grad(e.sum() + fast.sum() + reference.sum(), g)
    assert torch.isfinite(ge).all()
    # length-1 sequence: everything exactly zero
    g1 = g[:, :1].detach()
    assert torch.equal(_energy(kind, g1, w, alpha, 1.0, "strict"), torch.zeros(2, 1, dtype=torch.float64))
    assert torch.equal(_grads(kind, g1, w, alpha, 1.0, "strict")[0], torch.zeros(2, 1, D, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
def test_attention_energy_and_force_are_causal(kind, mask):
    """docs/testing.md §3: E_i and the force from a truncated prefix equal those from the full sequence."""
    torch.manual_seed(9)
    g = torch.randn(2, 9, D, dtype=torch.float64)
    w, alpha = _attn_params(kind, 4)
    e_full = _energy(kind, g, w, alpha, 1.0, mask)
    f_full = _grads(kind, g, w, alpha, 1.0, mask)[0]
    for n in (1, 4, 8):
        torch.testing.assert_close(_energy(kind, g[:, :n], w, alpha, 1.0, mask), e_full[:, :n], atol=1e-12, rtol=0)
        torch.testing.assert_close(_grads(kind, g[:, :n], w, alpha, 1.0, mask)[0], f_full[:, :n], atol=1e-12, rtol=0)


def test_attention_energy_value_against_plain_loop():
    """Energy formula itself, written as a literal double loop (docs/nrgpt.md §2)."""
    torch.manual_seed(11)
    H, N = 2, 5
    g = torch.randn(1, N, D, dtype=torch.float64)
    w, alpha = _attn_params("full", H)
    J, beta = w["J"], 0.8
    for mask in ("strict", "inclusive"):
        e = E.attention_energy(g, J, alpha, beta, mask == "strict")
        for A in range(N):
            ctx = range(A) if mask == "strict" else range(A + 1)
            ref = 0.0
            for h in range(H):
                s = [beta * float(g[0, B] @ J[h] @ g[0, A]) for B in ctx]
                if s:
                    ref -= float(alpha[h]) / beta * math.log(sum(math.exp(v) for v in s))
            assert abs(float(e[0, A]) - ref) < 1e-12


def test_attention_dropout_only_changes_forces_when_p_positive():
    torch.manual_seed(0)
    g = torch.randn(2, 6, D, dtype=torch.float64)
    w, alpha = _attn_params("full", 2)
    base = E.attention_grad(g, w["J"], alpha, 1.0, True)
    torch.testing.assert_close(E.attention_grad(g, w["J"], alpha, 1.0, True, dropout_p=0.0), base)
    assert not torch.allclose(E.attention_grad(g, w["J"], alpha, 1.0, True, dropout_p=0.5), base)


# ------------------------------------------------------------------------------------------------
# feed-forward energies
# ------------------------------------------------------------------------------------------------
def _ff_params(kind, d=D, M=3 * D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.5 * torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "ff1":
        return (r(M, d), r(M))
    if kind == "ff2w":
        return (r(M, d), r(M), r(d, M), r(d))
    return (r(d, d), r(d), r(M, d), r(M))


FF = {"ff1": (E.ff1_energy, E.ff1_grad), "ff2w": (E.ff2w_energy, E.ff2w_grad), "ff2": (E.ff2_energy, E.ff2_grad)}


@pytest.mark.parametrize("kind", ["ff1", "ff2w", "ff2"])
@pytest.mark.parametrize("N", [1, 7, 33])
def test_ff_grad_matches_autograd(kind, N):
    energy, grad = FF[kind]
    torch.manual_seed(N)
    g = torch.randn(2, N, D, dtype=torch.float64, requires_grad=True)
    w = _ff_params(kind, seed=N)
    e = energy(g, *w)
    assert e.shape == (2, N)
    (ref,) = torch.autograd.grad(e.sum(), g)  # tokens are independent: grad of the sum = per-token partial
    out = grad(g.detach(), *w)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert ref.abs().max() > 1e-3
    # also torch.func.grad, as the reference code computes it, per token
    fg = torch.func.vmap(torch.func.grad(lambda x: energy(x[None, None], *w).sum()))(g.detach().reshape(-1, D))
    torch.testing.assert_close(out.reshape(-1, D), fg, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["ff1", "ff2w"])
@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_ff_grad_equals_reference_forward_and_backward(kind, N, bias):
    """The fused autograd.Function fast paths == the plain formulas, values and all gradients."""
    fast = {"ff1": E.ff1_grad, "ff2w": E.ff2w_grad}[kind]
    reference = {"ff1": E.ff1_grad_reference, "ff2w": E.ff2w_grad_reference}[kind]
    w = [p if (bias or i % 2 == 0) else None for i, p in enumerate(_ff_params(kind, seed=N))]
    g = torch.randn(2, N, D, dtype=torch.float64)
    cot = torch.randn(2, N, D, dtype=torch.float64)
    outs = []
    for fn in (fast, reference):
        leaves = [g.clone().requires_grad_(True)] + [None if p is None else p.clone().requires_grad_(True) for p in w]
        out = fn(*leaves)
        grads = torch.autograd.grad((out * cot).sum(), [t for t in leaves if t is not None])
        outs.append((out.detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=ATOL, rtol=0)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    leaves = ([g[:, :3].clone().requires_grad_(True)]
              + [None if p is None else p.clone().requires_grad_(True) for p in w])
    assert torch.autograd.gradcheck(fast, tuple(leaves))


def test_fused_gelu_parts_avoid_subnormals_and_stay_exact():
    """The fused path clamps φ/Φ tails (subnormals are ~10× slower on CPU); values stay exact to 1e-20."""
    z64 = torch.linspace(-60, 60, 4801, dtype=torch.float64)
    s, sp, spp = E._gelu_parts(z64)
    pdf = torch.exp(-0.5 * z64 ** 2) / math.sqrt(2 * math.pi)
    tail = z64.abs() >= 10
    for got, ref in ((s, F.gelu(z64)), (sp, E.gelu_prime(z64)), (spp, pdf * (2 - z64 ** 2))):
        torch.testing.assert_close(got, ref, atol=1e-15, rtol=1e-12)
        assert ((got - ref)[tail].abs() / (1 + z64[tail].abs())).max() < 1e-20
    tiny = torch.finfo(torch.float32).tiny
    torch.set_flush_denormal(False)  # process-wide; another test may have left it on
    for t in E._gelu_parts(z64.float()):
        assert not ((t != 0) & (t.abs() < tiny)).any()  # no float32 subnormals
    # the reference one has them
    assert ((E.gelu_prime(z64.float()).abs() < tiny) & (E.gelu_prime(z64.float()) != 0)).any()


def test_ff_energy_values_plain():
    torch.manual_seed(1)
    g = torch.randn(1, 3, D, dtype=torch.float64)
    W1, b1, W2, b2 = _ff_params("ff2w")
    z = g @ W1.T + b1
    s = z * 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    torch.testing.assert_close(E.ff1_energy(g, W1, b1), -(s ** 2).sum(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(E.ff2w_energy(g, W1, b1, W2, b2), -(g * (s @ W2.T + b2)).sum(-1), atol=1e-12, rtol=0)


def test_gelu_prime_matches_autograd():
    z = torch.linspace(-6, 6, 241, dtype=torch.float64, requires_grad=True)
    (ref,) = torch.autograd.grad(F.gelu(z).sum(), z)
    torch.testing.assert_close(E.gelu_prime(z.detach()), ref, atol=1e-13, rtol=0)


def test_bad_mask_and_shapes_raise():
    g = torch.randn(1, 3, D, dtype=torch.float64)
    w, alpha = _attn_params("full", 2)
    with pytest.raises(ValueError, match="strict='causal' must be a bool"):
        E.attention_energy(g, w["J"], alpha, 1.0, "causal")
    with pytest.raises(ValueError, match="strict='inclusive' must be a bool"):  # the old string argument
        E.attention_grad(g, w["J"], alpha, 1.0, "inclusive")
    with pytest.raises(ValueError, match="alpha"):
        E.attention_grad(g, w["J"], torch.ones(3, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="context"):
        E.attention_energy(g, w["J"], alpha, 1.0, context=g[:, :2])
