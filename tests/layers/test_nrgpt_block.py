"""NRGPTBlock (docs/nrgpt.md §4, docs/testing.md §1–§3): analytic step == autograd on the energy, η forms, causality,
and equality with a plain autograd-based re-implementation of the reference code's block."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from energyformer.energies import nrgpt as E
from energyformer.layers.nrgpt import NRGPTBlock
from energyformer.layers.step_maps import STEP_MAPS
from energyformer.models.nrgpt import NRGPT, NRGPTConfig

D = 8
ATOL = 1e-10
NORMS = ["layernorm", "rmsnorm", "layernorm_frozen", None]




def randomize_(module, seed=0):
    """O(1)-scale random parameters (the 0.02 init would make every check nearly vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if name.endswith(("alpha", "ff_scale")) or name == "step_scales":
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith("c_raw"):
                continue
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(fan_in))
    return module


def make_block(H=2, d=D, seed=0, **kw):
    kw.setdefault("d_ff", 2 * d)
    if kw.get("attention") == "factored":
        kw.setdefault("head_dim", 4)
    blk = NRGPTBlock(d, H, **kw).double()
    return randomize_(blk, seed)


def autograd_step(blk, x, scale=None):
    """x − κ η (∂E_AT/∂g + s_ff ∂E_FF/∂g) with both partial gradients from torch.autograd on the energies."""
    g = blk.normalize(x).detach()
    gq = g.clone().requires_grad_(True)
    if blk.attention.name == "full":
        e_attn = E.attention_energy(gq, blk.attention.J, blk.alpha, blk.beta, blk.attention.strict, context=g)
    else:
        e_attn = E.attention_energy_factored(gq, *blk.attention._qk(), blk.alpha, blk.beta, blk.attention.strict,
                                             context=g)
    energy = {"ff1": E.ff1_energy, "ff2w": E.ff2w_energy, "ff2": E.ff2_energy}[blk.ff.name]
    e_ff = energy(gq, *blk.ff.weights())
    (ga,) = torch.autograd.grad(e_attn.sum(), gq)
    (gf,) = torch.autograd.grad(e_ff.sum(), gq)
    force = ga + blk.ff_scale * gf
    step = force @ blk.eta_matrix().T
    return x - (step if scale is None else scale * step)


@pytest.mark.parametrize("attention", ["full", "factored"])
@pytest.mark.parametrize("ff", ["ff1", "ff2w", "ff2"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
def test_block_step_matches_autograd_all_options(attention, ff, mask):
    torch.manual_seed(0)
    x = 1.5 * torch.randn(2, 7, D, dtype=torch.float64)
    for eta_param, norm in itertools.product(STEP_MAPS.names(), NORMS):
        if eta_param == "c_diag_gamma" and norm is None:
            continue
        blk = make_block(attention=attention, ff=ff, mask=mask, eta_param=eta_param, norm=norm, c_init=0.3,
                         eta_rank=3)
        with torch.no_grad():
            out = blk(x)
            out_k = blk(x, scale=0.7)
        ref = autograd_step(blk, x)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=f"{eta_param} {norm}")
        torch.testing.assert_close(out_k, autograd_step(blk, x, scale=0.7), atol=ATOL, rtol=0)
        assert (out - x).abs().max() > 1e-4


@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.parametrize("N", [1, 7, 33])
def test_block_step_matches_autograd_shapes(H, N):
    torch.manual_seed(N)
    x = torch.randn(2, N, D, dtype=torch.float64)
    for attention in ("full", "factored"):
        blk = make_block(H=H, attention=attention, seed=N + H)
        with torch.no_grad():
            out = blk(x)
        assert out.shape == x.shape
        torch.testing.assert_close(out, autograd_step(blk, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_eta_forms(norm):
    v = torch.randn(2, 3, D, dtype=torch.float64)
    for eta_param in STEP_MAPS.names():
        if eta_param == "c_diag_gamma" and norm is None:
            continue
        blk = make_block(eta_param=eta_param, norm=norm, c_init=0.25, eta_rank=3)
        eta = blk.eta_matrix()
        torch.testing.assert_close(blk.apply_eta(v), v @ eta.T, atol=1e-12, rtol=0)
        if eta_param == "c_identity":
            torch.testing.assert_close(eta, 0.25 * torch.eye(D, dtype=torch.float64))
        if eta_param == "c_diag_gamma":
            torch.testing.assert_close(eta, torch.diag(0.25 * blk.norm.weight.detach()))
        if eta_param == "psd_plus_skew":
            sym = (eta + eta.T) / 2
            assert torch.linalg.eigvalsh(sym).min() >= -1e-12
            torch.testing.assert_close((eta - eta.T) / 2, blk.eta.S - blk.eta.S.T)


@pytest.mark.parametrize("attention", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
@pytest.mark.parametrize("ff", ["ff1", "ff2w", "ff2"])
def test_block_is_causal(attention, mask, ff):
    torch.manual_seed(1)
    N, i = 9, 4
    x = torch.randn(2, N, D, dtype=torch.float64)
    x2 = x.clone()
    x2[:, i + 1:] = torch.randn(2, N - i - 1, D, dtype=torch.float64)
    for eta_param, norm in [("full", "layernorm"), ("c_diag_gamma", "rmsnorm"), ("psd_plus_skew", None)]:
        blk = make_block(attention=attention, mask=mask, ff=ff, eta_param=eta_param, norm=norm)
        with torch.no_grad():
            y, y2 = blk(x), blk(x2)
            e, e2 = blk.energy(x), blk.energy(x2)
        assert torch.equal(y[:, :i + 1], y2[:, :i + 1])
        assert not torch.allclose(y[:, i + 1:], y2[:, i + 1:])
        for k in ("attn", "ff"):
            torch.testing.assert_close(e[k][:, :i + 1], e2[k][:, :i + 1], atol=1e-13, rtol=0)


def test_energy_terms_shapes_and_scale():
    blk = make_block(H=4)
    x = torch.randn(3, 5, D, dtype=torch.float64)
    e = blk.energy(x)
    assert set(e) == {"attn", "ff"} and e["attn"].shape == (3, 5) and e["ff"].shape == (3, 5)
    g = blk.normalize(x)
    torch.testing.assert_close(e["ff"], blk.ff_scale * E.ff2w_energy(g, *blk.ff.weights()))
    torch.testing.assert_close(e["attn"], E.attention_energy(g, blk.attention.J, blk.alpha, blk.beta, True))
    assert torch.equal(e["attn"][:, 0], torch.zeros(3, dtype=torch.float64))  # strict: token 0 has no context


def test_parameters_by_option_and_gradients_reach_all():
    full = NRGPTBlock(16, 4)
    assert full.attention.J.shape == (4, 16, 16) and isinstance(full.alpha, torch.nn.Parameter)
    assert full.beta == 1.0 and full.mask == "strict" and full.ff.name == "ff2w" and full.d_ff == 64
    fac = NRGPTBlock(16, 4, attention="factored")
    assert fac.attention.q_proj.weight.shape == (16, 16) and fac.attention.k_proj.weight.shape == (16, 16)
    assert not hasattr(fac.attention, "J") and fac.beta == pytest.approx(0.5)
    fixed = NRGPTBlock(16, 4, learn_alpha=False, norm="layernorm_frozen")
    names = dict(fixed.named_parameters())
    assert "attention.alpha" not in names and "attention.alpha" not in fixed.state_dict()
    assert not fixed.norm.weight.requires_grad
    for kw in ({}, dict(attention="factored", ff="ff1"), dict(ff="ff2", eta_param="c_diag_gamma"),
               dict(eta_param="psd_plus_skew", norm=None), dict(eta_param="c_identity", norm="rmsnorm")):
        blk = make_block(**kw)
        x = torch.randn(2, 5, D, dtype=torch.float64)
        blk(blk(x)).pow(2).sum().backward()
        for n, p in blk.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().sum() > 0, (kw, n)


def test_block_training_uses_no_autograd_of_energy(monkeypatch):
    """docs/architecture.md: the hot path is the analytic update (no torch.autograd.grad / double backward)."""
    blk = make_block(ff="ff2")

    def boom(*a, **k):
        raise AssertionError("autograd.grad called in the block forward/backward")

    monkeypatch.setattr(torch.autograd, "grad", boom)
    monkeypatch.setattr(torch.func, "grad", boom)
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    blk(x).sum().backward()
    assert x.grad is not None


def test_bad_options_raise():
    with pytest.raises(ValueError, match="n_heads"):
        NRGPTBlock(10, 4)
    with pytest.raises(ValueError, match="c_init=0.0 must be a finite number > 0 for step map 'c_identity'"):
        NRGPTBlock(8, 2, eta_param="c_identity", c_init=0.0)
    with pytest.raises(ValueError, match="c_init=-1.0 must be a finite number >= 0 for step map 'full'"):
        NRGPTBlock(8, 2, c_init=-1.0)
    with pytest.raises(ValueError, match="c_diag_gamma"):
        NRGPTBlock(8, 2, eta_param="c_diag_gamma", norm=None)
    for kw, name in [(dict(attention="lowrank"), "attention"), (dict(mask="causal"), "mask"),
                     (dict(ff="ff3"), "ff"), (dict(eta_param="adam"), "eta_param='adam'"),
                     (dict(norm="batchnorm"), "norm"), (dict(beta=0.0), "beta"), (dict(dropout=1.0), "dropout")]:
        with pytest.raises(ValueError, match=name):
            NRGPTBlock(8, 2, **kw)


# ------------------------------------------------------------------------------------------------
# Plain re-implementation of the released code's block (docs/nrgpt.md §2–§4, docs/testing.md §2 last bullet):
# per-head Linear H (xH = H(g)), scores g_A·xH_B, tril mask (diagonal −1 for tril_plus_one),
# fully masked rows zeroed, force = −Σ_heads wei @ xH, FF force by torch.func.grad of the summed
# FF energy, BareLN (γ ≡ 1, learnable bias), x ← x − proj(attn + scale_ff · ff).
# ------------------------------------------------------------------------------------------------
def reference_block(x, Hs, ln_bias, ff_kind, ff_params, proj_w, scale_ff, tril_plus_one):
    T, d = x.shape[1], x.shape[2]
    g = F.layer_norm(x, (d,), weight=torch.ones(d, dtype=x.dtype), bias=ln_bias, eps=1e-5)
    tril = torch.tril(torch.ones(T, T, dtype=x.dtype), diagonal=-1 if tril_plus_one else 0)
    attn = 0
    for W in Hs:
        xH = g @ W.T
        wei = g @ xH.transpose(-2, -1)
        wei = wei.masked_fill(tril == 0, float("-inf"))
        wei = torch.softmax(wei, dim=-1)
        wei = wei.masked_fill(torch.all(tril == 0, dim=-1, keepdim=True), 0.0)
        attn = attn + (-(wei @ xH))

    def net(v):
        if ff_kind == "ff1":
            (W1, b1) = ff_params
            return F.gelu(v @ W1.T + b1)
        if ff_kind == "ff2":
            (Wa, a, Wb, b) = ff_params
            return F.gelu(F.gelu(v @ Wa.T + a) @ Wb.T + b)
        (W1, b1, W2, b2) = ff_params
        return F.gelu(v @ W1.T + b1) @ W2.T + b2

    if ff_kind == "ff2w":
        energy = lambda v: -(v * net(v)).sum()  # noqa: E731
    else:
        energy = lambda v: -(net(v) ** 2).sum()  # noqa: E731
    ff = torch.func.grad(energy)(g)
    return x - (attn + scale_ff * ff) @ proj_w.T


def _ref_args(blk):
    ffp = tuple(p.detach() for p in blk.ff.weights())
    Hs = [blk.attention.J[h].detach().T for h in range(blk.n_heads)]  # reference H.weight = J_hᵀ
    return Hs, blk.norm.bias.detach(), blk.ff.name, ffp, blk.eta.weight.detach(), blk.ff_scale.detach()


@pytest.mark.parametrize("ff", ["ff1", "ff2w", "ff2"])
@pytest.mark.parametrize("task", ["lm", "listops"])
@pytest.mark.parametrize("N", [1, 7])
def test_reference_block_matches_plain_reimplementation(ff, task, N):
    cfg = NRGPTConfig.reference(task, d_model=D, n_heads=2, ff=ff, d_ff=3 * D, vocab_size=11, block_size=16)
    model = NRGPT(cfg).double()
    randomize_(model, seed=3)
    blk = model.block
    assert blk.mask == ("inclusive" if task == "lm" else "strict")
    assert "block.attention.alpha" not in dict(model.named_parameters()) and blk.beta == 1.0
    x = 1.3 * torch.randn(2, N, D, dtype=torch.float64)
    with torch.no_grad():
        out = blk(x)
    ref = reference_block(x, *_ref_args(blk), tril_plus_one=(task == "listops"))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("task", ["lm", "listops"])
def test_reference_model_matches_plain_reimplementation(task):
    cfg = NRGPTConfig.reference(task, d_model=D, n_heads=2, n_steps=3, vocab_size=11, block_size=16)
    model = randomize_(NRGPT(cfg).double(), seed=4).eval()
    idx = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        x = model.wte.weight[idx] + model.wpe.weight[:9]
        for _ in range(3):
            x = reference_block(x, *_ref_args(model.block), tril_plus_one=(task == "listops"))
        x = F.layer_norm(x, (D,), model.ln_f.weight, model.ln_f.bias, 1e-5)
        ref = x @ model.lm_head.weight.T + model.lm_head.bias
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
