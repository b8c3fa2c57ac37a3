"""CEM layers (energyformer/layers/cem.py, preconditioner.py, rope.py): docs/cem.md §2–§7, docs/testing.md §1–§9.

Layer updates are held against ``x − η P ∇_g ε(g)`` with ``∇_g ε`` from torch.autograd on the
energy (context detached), in float64.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import perturb

from energyformer.energies.cem import interaction_energy, interaction_grad
from energyformer.energies.heads import apply_rope, rope_cos_sin
from energyformer.layers.cem import CEMAttention, CEMBlock, CEMGatedMLP
from energyformer.layers.cem_options import INTERACTIONS as INTERACTION_REGISTRY
from energyformer.layers.cem_options import MLP_TIES
from energyformer.layers.step_maps import preconditioner
from energyformer.layers.trace import tracing

DT = torch.float64
ATOL = 1e-10
D, H = 16, 4
DH = D // H
INTERACTIONS = ["lowrank", "diag_shared", "diag_per_head", "diag_only"]
PRECONDS = [None, "diag", "diag_lowrank", "diag_lowrank_psd"]


_perturb = partial(perturb, scale=0.3)


def _x(n, seed=1, b=2, d=D):
    return torch.randn(b, n, d, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _attn(**kw):
    torch.manual_seed(0)
    kw.setdefault("rope", None)
    return CEMAttention(D, H, **kw).double()


def _precond_matrix(layer):
    return torch.eye(D, dtype=DT) if layer.preconditioner is None else layer.preconditioner.matrix()


def _attn_autograd_update(layer, x):
    """``x − η P ∇_g ε_att(g | ĥ)`` with ∇ from autograd (ĥ detached), one step."""
    with torch.no_grad():
        h_hat = layer._normalize(x)
    rope = rope_cos_sin(x.shape[1], DH, layer.rotary.theta, dtype=DT) if layer.rotary is not None else None
    w_q = None if layer.q_proj is None else layer.q_proj.weight.detach()
    w_k = None if layer.k_proj is None else layer.k_proj.weight.detach()
    diag = None if layer.diag is None else layer.diag.detach()
    g = h_hat.clone().requires_grad_(True)
    e = interaction_energy(g, h_hat, w_q, w_k, H, diag=diag, rope=rope, tau=math.sqrt(DH))
    (grad,) = torch.autograd.grad(e.sum(), g)
    with torch.no_grad():
        return x - layer.step_size_at(0) * grad @ _precond_matrix(layer).t()


# ----------------------------------------------------------------------------- one-step equivalences

def test_attention_one_step_is_sdpa_then_wq():
    layer = _attn()
    x = _x(33)
    with torch.no_grad():
        g = layer.norm(x)
        q = (g @ layer.q_proj.weight.t()).view(2, 33, H, DH).transpose(1, 2)
        k = (g @ layer.k_proj.weight.t()).view(2, 33, H, DH).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, k, is_causal=True)
        expected = x + y.transpose(1, 2).reshape(2, 33, D) @ layer.q_proj.weight
        torch.testing.assert_close(layer(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie", ["gate", "up"])
def test_mlp_one_step_is_swiglu_with_transposed_down(tie):
    torch.manual_seed(0)
    layer = CEMGatedMLP(D, 24, mlp_tie=tie).double()
    x = _x(7)
    with torch.no_grad():
        g = layer.norm(x)
        wg, wu = layer.gate_proj.weight, layer.up_proj.weight
        down = (wg if tie == "gate" else wu).t()  # (d, d_ff) as an nn.Linear weight
        expected = x + (F.silu(g @ wg.t()) * (g @ wu.t())) @ down.t()
        torch.testing.assert_close(layer(x), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope", ["llama", "exact"])
def test_llama_rope_mode_is_llama_attention_and_exact_differs(rope):
    layer = _attn(rope="llama")
    exact = _attn(rope="exact")
    exact.load_state_dict(layer.state_dict())
    x = _x(9)
    with torch.no_grad():
        g = layer.norm(x)
        cos, sin = rope_cos_sin(9, DH, dtype=DT)
        q = apply_rope((g @ layer.q_proj.weight.t()).view(2, 9, H, DH).transpose(1, 2), cos, sin)
        k_raw = (g @ layer.k_proj.weight.t()).view(2, 9, H, DH).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, apply_rope(k_raw, cos, sin), k_raw, is_causal=True)
        llama = x + y.transpose(1, 2).reshape(2, 9, D) @ layer.q_proj.weight
        torch.testing.assert_close(layer(x), llama, atol=ATOL, rtol=0)
        assert (exact(x) - layer(x))[:, 1:].abs().max() > 1e-4  # exact mode is a different map


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_attention_update_matches_autograd(n, interaction):
    rope = None if interaction == "diag_only" else "exact"
    layer = _perturb(_attn(interaction=interaction, rope=rope))
    x = _x(n)
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, _attn_autograd_update(layer, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("precond", PRECONDS[1:])
@pytest.mark.parametrize("interaction", ["lowrank", "diag_shared"])
def test_preconditioned_attention_update_matches_autograd(precond, interaction):
    layer = _perturb(_attn(interaction=interaction, rope="exact", preconditioner=precond, preconditioner_rank=3))
    x = _x(7)
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, _attn_autograd_update(layer, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie", ["gate", "up"])
@pytest.mark.parametrize("precond", [None, "diag_lowrank"])
def test_mlp_update_matches_autograd(tie, precond):
    torch.manual_seed(0)
    layer = _perturb(CEMGatedMLP(D, 24, mlp_tie=tie, preconditioner=precond, preconditioner_rank=3).double())
    x = _x(7)
    with torch.no_grad():
        h_hat = layer.norm(x)
    g = h_hat.clone().requires_grad_(True)
    e = MLP_TIES.get(tie).energy(g, h_hat, layer.gate_proj.weight.detach(), layer.up_proj.weight.detach())
    (grad,) = torch.autograd.grad(e.sum(), g)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x - layer.step_size_at(0) * grad @ _precond_matrix(layer).t(),
                                   atol=ATOL, rtol=0)


def test_grad_through_norm_is_the_true_x_gradient():
    """docs/cem.md §7 alternative: the update uses ∇_x ε(Norm(x) | ĥ) with ĥ fixed."""
    layer = _perturb(_attn(interaction="diag_shared", rope="exact", grad_through_norm=True, n_steps=2))
    x = _x(7)
    with torch.no_grad():
        h_hat = layer.norm(x)
        rope = rope_cos_sin(7, DH, dtype=DT)
    w = dict(w_q=layer.q_proj.weight.detach(), w_k=layer.k_proj.weight.detach())
    xt = x.clone()
    for t in range(2):
        xr = xt.clone().requires_grad_(True)
        e = interaction_energy(layer.norm(xr), h_hat, w["w_q"], w["w_k"], H, diag=layer.diag.detach(), rope=rope)
        (grad,) = torch.autograd.grad(e.sum(), xr)
        xt = (xt - layer.step_size_at(t) * grad).detach()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), xt, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- recursion

@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_attention_recursion_is_repeated_one_step_map_with_fixed_context(interaction):
    rope = None if interaction == "diag_only" else "exact"
    layer = _perturb(_attn(interaction=interaction, rope=rope, n_steps=3, per_step_scale=True,
                           preconditioner="diag_lowrank", preconditioner_rank=2))
    x = _x(7)
    with torch.no_grad(), tracing(layer) as tr:
        out = layer(x)
    trace = tr.records
    with torch.no_grad():
        h_hat = layer.norm(x)  # context from the sub-block input, fixed over the steps
        r = rope_cos_sin(7, DH, dtype=DT) if rope else None
        w_q = None if layer.q_proj is None else layer.q_proj.weight
        w_k = None if layer.k_proj is None else layer.k_proj.weight
        xt = x
        for t in range(3):
            torch.testing.assert_close(trace[t].x, xt, atol=ATOL, rtol=0)
            grad = interaction_grad(layer.norm(xt), h_hat, w_q, w_k, H, diag=layer.diag, rope=r, tau=math.sqrt(DH))
            xt = xt - layer.step_scales[t] * layer.preconditioner(grad)  # η ≡ 1 with P
        torch.testing.assert_close(out, xt, atol=ATOL, rtol=0)
        torch.testing.assert_close(trace[3].x, xt, atol=ATOL, rtol=0)
        assert [e.step for e in trace] == [0, 1, 2, 3]
        assert {e.sub for e in trace} == {"attn"}


@pytest.mark.parametrize("tie", ["gate", "up"])
def test_mlp_recursion_is_repeated_one_step_map_with_fixed_gate(tie):
    torch.manual_seed(0)
    layer = _perturb(CEMGatedMLP(D, 24, n_steps=3, mlp_tie=tie).double())
    x = _x(7)
    with torch.no_grad():
        h_hat = layer.norm(x)
        xt = x
        for _t in range(3):
            w_gate, w_up = layer.gate_proj.weight, layer.up_proj.weight
            ctx = MLP_TIES.get(tie).context(h_hat, w_gate, w_up)
            xt = xt - layer.step_size * MLP_TIES.get(tie).grad(layer.norm(xt), h_hat, w_gate, w_up, ctx)
        torch.testing.assert_close(layer(x), xt, atol=ATOL, rtol=0)


def test_parameters_are_shared_over_steps_and_gradients_accumulate():
    """docs/testing.md §8: one W_Q/W_K for all T steps; its gradient is the sum of the per-step contributions."""
    layer = _perturb(_attn(n_steps=2, norm=None))
    n1 = sum(p.numel() for p in _attn(n_steps=1, norm=None).parameters())
    assert sum(p.numel() for p in layer.parameters()) == n1
    x = _x(7)
    target = _x(7, seed=9)
    ((layer(x) - target) ** 2).sum().backward()
    # the same unrolled computation with an independent copy of W_Q, W_K per step
    wq = [layer.q_proj.weight.detach().clone().requires_grad_(True) for _ in range(2)]
    wk = [layer.k_proj.weight.detach().clone().requires_grad_(True) for _ in range(2)]
    eta = layer.step_size.detach()
    xt = x
    for t in range(2):
        xt = xt - eta * interaction_grad(xt, x, wq[t], wk[t], H)
    ((xt - target) ** 2).sum().backward()
    torch.testing.assert_close(layer.q_proj.weight.grad, wq[0].grad + wq[1].grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.k_proj.weight.grad, wk[0].grad + wk[1].grad, atol=ATOL, rtol=0)
    assert wq[0].grad.abs().max() > 1e-6 and wq[1].grad.abs().max() > 1e-6


def test_step_size_init_and_preconditioner_fixes_eta():
    def eta(layer):
        return float(layer.step_size.detach())

    assert eta(_attn(n_steps=1)) == 1.0
    assert abs(eta(_attn(n_steps=4)) - 0.25) < 1e-12
    assert eta(_attn(n_steps=2, step_size=0.3)) == pytest.approx(0.3)
    assert abs(eta(CEMGatedMLP(D, 24, n_steps=2)) - 0.5) < 1e-12
    with_p = _attn(n_steps=2, preconditioner="diag")
    assert eta(with_p) == 1.0 and "step_size" not in dict(with_p.named_parameters())
    fixed = _attn(learn_step_size=False)
    assert "step_size" not in dict(fixed.named_parameters())
    scaled = _attn(n_steps=3, per_step_scale=True)
    assert scaled.step_scales.shape == (3,) and bool((scaled.step_scales == 1).all())


# ----------------------------------------------------------------------------- weight ties

def test_attention_state_dict_has_no_value_or_output_projection():
    layer = _attn(interaction="diag_shared")
    keys = set(layer.state_dict())
    assert keys == {"interaction.q_proj.weight", "interaction.k_proj.weight", "interaction.diag", "norm.weight",
                    "step_size"}
    assert not any(s in k for k in keys for s in ("v_proj", "o_proj", "value", "out"))
    assert layer.q_proj.weight.shape == (H * DH, D) and layer.k_proj.weight.shape == (H * DH, D)
    mlp = CEMGatedMLP(D, 24)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "norm.weight", "step_size"}


def test_q_proj_is_also_the_output_projection():
    """A gradient on W_Q has a query part and an output-projection part (o_proj = W_Qᵀ is the same tensor)."""
    layer = _perturb(_attn(norm=None))
    x, target = _x(7), _x(7, seed=5)
    ((layer(x) - target) ** 2).sum().backward()
    w_in = layer.q_proj.weight.detach().clone().requires_grad_(True)   # query projection copy
    w_out = layer.q_proj.weight.detach().clone().requires_grad_(True)  # output projection copy
    k = (x @ layer.k_proj.weight.detach().t()).view(2, 7, H, DH).transpose(1, 2)
    q = (x @ w_in.t()).view(2, 7, H, DH).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, k, is_causal=True).transpose(1, 2).reshape(2, 7, D)
    ((x + layer.step_size.detach() * y @ w_out - target) ** 2).sum().backward()
    assert w_out.grad.abs().max() > 1e-6 and w_in.grad.abs().max() > 1e-6
    torch.testing.assert_close(layer.q_proj.weight.grad, w_in.grad + w_out.grad, atol=ATOL, rtol=0)
    # a gradient step on q_proj moves the output map: the output changes as if both copies moved
    with torch.no_grad():
        layer.q_proj.weight -= 0.1 * layer.q_proj.weight.grad
        new_q = (x @ layer.q_proj.weight.t()).view(2, 7, H, DH).transpose(1, 2)
        y_new = F.scaled_dot_product_attention(new_q, k, k, is_causal=True).transpose(1, 2).reshape(2, 7, D)
        torch.testing.assert_close(layer(x), x + layer.step_size * y_new @ layer.q_proj.weight, atol=ATOL, rtol=0)
        only_query_moved = x + layer.step_size * y_new @ w_out
        assert (layer(x) - only_query_moved).abs().max() > 1e-6


# ---------------------------------------------------------------- energy descent (docs/cem.md §9, docs/testing.md §5)

@pytest.mark.parametrize("interaction,rope", [("lowrank", None), ("lowrank", "exact"), ("diag_shared", "exact"),
                                              ("diag_per_head", None), ("diag_only", None)])
@pytest.mark.parametrize("precond", ["diag", "diag_lowrank_psd"])
@pytest.mark.parametrize("eta", [0.1, 1.0, 10.0])
def test_raw_attention_energy_decreases_every_step_with_psd_preconditioner(interaction, rope, precond, eta):
    layer = _perturb(_attn(interaction=interaction, rope=rope, n_steps=6, norm=None, preconditioner=precond,
                           preconditioner_rank=3, per_step_scale=True), seed=3)
    with torch.no_grad():
        layer.step_scales.fill_(eta)
        assert torch.linalg.eigvalsh(layer.preconditioner.matrix()).min() > 0
        with tracing(layer) as trace:
            layer(_x(9))
    e = trace.energy("attn")  # (T+1, B, N)
    assert bool((e[1:] <= e[:-1] + 1e-9).all()), (e[1:] - e[:-1]).max()
    assert bool((e[-1] < e[0] - 1e-6).any())  # it really moves


def test_indefinite_preconditioner_exists_for_random_factors():
    """docs/cem.md §5/docs/testing.md §6: diag(softplus p) + UVᵀ + VUᵀ is symmetric but not PSD in general."""
    p = preconditioner(D, "diag_lowrank", rank=4)
    with torch.no_grad():
        p.u.normal_(generator=torch.Generator().manual_seed(0))
        p.v.normal_(generator=torch.Generator().manual_seed(1))
    m = p.matrix()
    assert torch.equal(m, m.t())
    assert torch.linalg.eigvalsh(m.double()).min() < -0.5


# ----------------------------------------------------------------------------- preconditioner

@pytest.mark.parametrize("kind", ["diag", "diag_lowrank", "diag_lowrank_psd"])
def test_preconditioner_identity_at_init_symmetric_and_matrix_free(kind):
    p = preconditioner(D, kind, rank=4)
    torch.testing.assert_close(p.matrix(), torch.eye(D), atol=1e-6, rtol=0)
    v = torch.randn(3, 5, D)
    torch.testing.assert_close(p(v), v, atol=1e-6, rtol=0)
    torch.testing.assert_close(preconditioner(D, kind, rank=4, init_scale=0.25).matrix(), 0.25 * torch.eye(D),
                               atol=1e-6, rtol=0)  # the layers pass s = 1/T
    _perturb(p, scale=0.5).double()
    m = p.matrix()
    assert torch.equal(m, m.t())
    vd = v.double()
    torch.testing.assert_close(p(vd), vd @ m.t(), atol=ATOL, rtol=0)
    if kind != "diag_lowrank":
        assert torch.linalg.eigvalsh(m).min() > 0


@pytest.mark.parametrize("kind", ["diag", "diag_lowrank", "diag_lowrank_psd"])
def test_preconditioner_is_trainable_at_init(kind):
    p = preconditioner(D, kind, rank=4)
    v, w = torch.randn(5, D), torch.randn(5, D)
    (p(v) * w).sum().backward()
    assert p.p.grad.abs().max() > 0
    if kind == "diag_lowrank":
        assert p.v.grad.abs().max() > 0  # V = 0 at init still gets a gradient
    if kind == "diag_lowrank_psd":
        assert p.lr_factor.grad.abs().max() > 0  # not the dead L = 0 init


def test_preconditioner_bad_options_raise():
    with pytest.raises(ValueError, match="preconditioner='lowrank'"):
        preconditioner(D, "lowrank")
    with pytest.raises(ValueError, match="preconditioner_rank=0"):
        preconditioner(D, "diag_lowrank", rank=0)
    with pytest.raises(ValueError, match="preconditioner_rank=20"):
        preconditioner(D, "diag_lowrank_psd", rank=20)
    for kind in ("diag_lowrank", "diag_lowrank_psd"):
        with pytest.raises(ValueError, match=f"preconditioner_rank={D} must be < d_model={D}"):
            preconditioner(D, kind, rank=D)
    preconditioner(D, "diag", rank=D)  # rank is unused by the diagonal form


# ----------------------------------------------------------------------------- causality of every state

@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_every_intermediate_state_is_causal(interaction):
    rope = None if interaction == "diag_only" else "exact"
    torch.manual_seed(0)
    block = _perturb(CEMBlock(D, H, 24, attn_n_steps=3, mlp_n_steps=2, interaction=interaction, rope=rope,
                              preconditioner="diag_lowrank", preconditioner_rank=2).double())
    x = _x(9)
    x2 = x.clone()
    x2[:, 5:] = _x(4, seed=7)
    with torch.no_grad():
        with tracing(block) as tr1:
            block(x)
        with tracing(block) as tr2:
            block(x2)
    t1, t2 = tr1.records, tr2.records
    assert len(t1) == 4 + 3
    assert [r.sub for r in t1] == ["attn"] * 4 + ["mlp"] * 3
    for a, b in zip(t1, t2):
        torch.testing.assert_close(a.x[:, :5], b.x[:, :5], atol=ATOL, rtol=0)
        for term in a.energies:
            torch.testing.assert_close(a.energies[term][:, :5], b.energies[term][:, :5], atol=ATOL, rtol=0)
    assert (t1[-1].x[:, 5:] - t2[-1].x[:, 5:]).abs().max() > 1e-3


def test_block_is_attention_then_mlp():
    torch.manual_seed(0)
    block = _perturb(CEMBlock(D, H, 24, attn_n_steps=2, rope="exact", interaction="diag_shared").double())
    x = _x(7)
    with torch.no_grad():
        torch.testing.assert_close(block(x), block.mlp(block.attn(x)), atol=0, rtol=0)


def test_energy_method_and_llama_mode_has_none():
    layer = _perturb(_attn(rope="exact", interaction="diag_shared"))
    x, h = _x(7), _x(7, seed=2)
    with torch.no_grad():
        e = layer.energy(x, h)
        ref = interaction_energy(layer.norm(x), layer.norm(h), layer.q_proj.weight, layer.k_proj.weight, H,
                                 diag=layer.diag, rope=rope_cos_sin(7, DH, dtype=DT))
    torch.testing.assert_close(e, ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="rope='llama'"):
        _attn(rope="llama").energy(x, h)


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,match", [
    (dict(n_steps=0), "n_steps=0"),
    (dict(n_heads=3), "n_heads=3 must divide d_model=16"),
    (dict(step_size=-0.5), "step_size=-0.5"),
    (dict(step_size=0.0), "step_size=0.0"),
    (dict(interaction="full"), "interaction='full'"),
    (dict(rope="compat"), "rope='compat'"),
    (dict(head_dim=5, rope="exact"), "head_dim=5"),
    (dict(interaction="diag_only", rope="exact"), "diag_only"),
    (dict(preconditioner="diag", step_size=0.5), "step_size=0.5 cannot be set"),
    (dict(preconditioner="lowrank"), "preconditioner='lowrank'"),
    (dict(norm="layernorm"), "norm='layernorm'"),
    (dict(norm=None, grad_through_norm=True), "grad_through_norm"),
])
def test_attention_bad_options_raise(kwargs, match):
    kw = dict(d_model=D, n_heads=H)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CEMAttention(**kw)


def test_head_dim_given_need_not_divide_and_bad_inputs_raise():
    layer = CEMAttention(D, 3, head_dim=6)  # 3 heads × 6 ≠ 16 is fine when head_dim is given
    assert layer.q_proj.weight.shape == (18, D)
    assert layer(torch.randn(2, 5, D)).shape == (2, 5, D)
    with pytest.raises(ValueError, match=r"\(B, N, d_model=16\)"):
        layer(torch.randn(2, 5, D + 1))
    with pytest.raises(ValueError, match="mlp_tie='down'"):
        CEMGatedMLP(D, 24, mlp_tie="down")
    with pytest.raises(ValueError, match="n_steps=0"):
        CEMGatedMLP(D, 24, n_steps=0)
    with pytest.raises(ValueError, match="step_size=-1"):
        CEMGatedMLP(D, 24, step_size=-1.0)


def test_the_removed_old_names_are_gone():
    """0.3.0 removed the deprecated aliases `Preconditioner(...)` and a CEM sub-block's `.eta(t)`
    (use `preconditioner(...)` and `.step_size_at(t)`; NRGPT's `.eta` is its step map)."""
    import energyformer.layers.step_maps as step_maps

    assert not hasattr(step_maps, "Preconditioner")
    assert not hasattr(CEMAttention(D, H, n_steps=2), "eta")



# ----------------------------------------------------------------------------- folded preconditioner
def _fwd_bwd(block, x, **kw):
    y = block(x, **kw) if kw else block(x)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    return y, torch.autograd.grad((y * cot).sum(), [x, *block.parameters()])


def _set_fold(block, on):
    for sub in (block.attn, block.mlp):
        sub.fold_preconditioner = on


@pytest.mark.parametrize("precond", ["diag", "diag_lowrank", "diag_lowrank_psd", "full", "psd_plus_skew"])
@pytest.mark.parametrize("interaction,tie", [("lowrank", "gate"), ("diag_shared", "up"), ("diag_shared", "gate"),
                                             ("diag_per_head", "gate")])
@pytest.mark.parametrize("mode", ["plain", "checkpoint", "backprop_steps"])
def test_folded_preconditioner_equals_preconditioner_applied_to_each_gradient(precond, interaction, tie, mode):
    """The fast path (``P`` folded into the output weights once per call) gives the plain path's
    output and the gradient of the input and of every parameter (float64), for every step map,
    T = 3, with per-step activation checkpointing and with a truncated backward too."""
    torch.manual_seed(0)
    block = _perturb(CEMBlock(D, H, 24, attn_n_steps=3, mlp_n_steps=3, interaction=interaction, mlp_tie=tie,
                              rope="exact", preconditioner=precond, preconditioner_rank=3).double())
    if mode == "checkpoint":
        block.attn.checkpoint_steps = block.mlp.checkpoint_steps = True
    kw = {"backprop_steps": 2} if mode == "backprop_steps" else {}
    x = _x(7).requires_grad_(True)
    fast = _fwd_bwd(block, x, **kw)
    _set_fold(block, False)
    plain = _fwd_bwd(block, x, **kw)
    torch.testing.assert_close(fast[0], plain[0], atol=ATOL, rtol=0)
    names = ["x", *(n for n, _ in block.named_parameters())]
    for name, a, b in zip(names, fast[1], plain[1]):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("interaction,attn_calls", [("lowrank", 1), ("diag_shared", 2), ("diag_per_head", 3)])
def test_folded_preconditioner_is_applied_once_per_call_not_once_per_step(interaction, attn_calls):
    """With the fold, ``P`` runs on weights (and the shared diagonal's values) once per call,
    whatever ``T``; the plain path (``fold_preconditioner = False``, a per-head diagonal,
    ``grad_through_norm``, tracing) applies it to each step's (B, N, d) gradient."""
    torch.manual_seed(0)
    block = CEMBlock(D, H, 24, attn_n_steps=3, mlp_n_steps=3, interaction=interaction,
                     preconditioner="diag_lowrank", preconditioner_rank=3).double()
    calls = {"attn": [], "mlp": []}
    for sub in ("attn", "mlp"):
        getattr(block, sub).preconditioner.register_forward_hook(
            lambda m, args, out, sub=sub: calls[sub].append(tuple(args[0].shape)))
    x = _x(7)
    block(x)
    assert len(calls["attn"]) == attn_calls and calls["mlp"] == [(24, D)]
    assert (2, 7, D) not in calls["attn"] or interaction != "lowrank"
    for sub in calls.values():
        sub.clear()
    _set_fold(block, False)
    block(x)
    assert calls == {"attn": [(2, 7, D)] * 3, "mlp": [(2, 7, D)] * 3}
    _set_fold(block, True)
    for sub in calls.values():
        sub.clear()
    with tracing(block):
        block(x)
    assert calls == {"attn": [(2, 7, D)] * 3, "mlp": [(2, 7, D)] * 3}  # the trace records ∇ε, then P∇ε


def test_folded_preconditioner_falls_back_for_ties_written_for_the_old_signature():
    """An MLP tie whose gradient takes no ``w_out`` (a plugin's ``grad_fn`` or ``grad`` from before
    the fold) gets ``P`` applied to each gradient, with the same result; the built-in ties fold."""
    base = MLP_TIES.get("gate")
    assert base.folds_step_map() and MLP_TIES.get("up").folds_step_map()

    def old_grad_fn(g, h_hat, w_gate, w_up, context=None):
        return base.grad_fn(g, h_hat, w_gate, w_up, context=context)

    class OldGradFn(base):
        grad_fn = staticmethod(old_grad_fn)

    class OldGrad(base):
        @classmethod
        def grad(cls, g, h_hat, w_gate, w_up, ctx):
            return base.grad_fn(g, h_hat, w_gate, w_up, context=ctx)

    torch.manual_seed(0)
    mlp = _perturb(CEMGatedMLP(D, 24, n_steps=2, preconditioner="diag_lowrank", preconditioner_rank=3).double())
    x = _x(5)
    with torch.no_grad():
        fast = mlp(x)
    for tie in (OldGradFn, OldGrad):
        assert not tie.folds_step_map()
        mlp.tie = tie
        assert mlp._folded(mlp._context(x)) is None
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), fast, atol=ATOL, rtol=0)


@pytest.mark.parametrize("base_name", ["lowrank", "diag_shared"])
def test_folded_preconditioner_falls_back_for_an_interaction_that_overrides_grad(base_name):
    """A subclass of a built-in interaction with its own ``grad`` (here ε + ½‖g‖²) gets ``P``
    applied to its gradient: the fold would drop what its ``grad`` adds."""
    base = INTERACTION_REGISTRY.get(base_name)

    class PlusQuadratic(base):
        def grad(self, g, h_hat, ctx):
            return super().grad(g, h_hat, ctx) + 0.5 * g

    layer = _perturb(_attn(interaction=base_name, n_steps=2, preconditioner="diag"))
    x = _x(7)
    assert layer._folded(layer._context(x)) is not None
    layer.interaction.__class__ = PlusQuadratic
    assert layer._folded(layer._context(x)) is None
    with torch.no_grad():
        fast = layer(x)
        layer.fold_preconditioner = False
        torch.testing.assert_close(fast, layer(x), atol=ATOL, rtol=0)
