"""Fast attention paths of the energy families (docs/nrgpt.md §2, docs/cem.md §4, issue 17 items 2–3):
each held equal to its plain reference in float64, forward and backward (w.r.t. the inputs and
every parameter), on odd shapes; and each shown to take the SDPA call it promises (``is_causal=True``,
no explicit mask), which is what makes the flash / cuDNN / memory-efficient GPU kernels eligible.

* NRGPT, strict mask: the shifted stream (queries 1 … N−1 against keys 0 … N−2, inclusive causal)
  against the explicit masked softmax / log-sum-exp (``*_reference``), update and energy, pure
  functions, the block (``use_reference``) and the cached-decoding functions.
* CEM ``diag_shared``: augmented heads through SDPA (``diag_shared_grad_sdpa``) against the dense
  scores (``diag_shared_grad_dense``, the CPU default) and the per-element reference; in a layer
  and a model the path is forced with ``force_attention_path`` (the entry's own ``sdpa`` attribute
  is deprecated).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from energyformer.energies import cem as C
from energyformer.energies import heads
from energyformer.energies import nrgpt as E
from energyformer.energies.heads import force_attention_path, rope_cos_sin
from energyformer.layers.cem import CEMAttention
from energyformer.layers.nrgpt import NRGPTBlock

DT = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
NS = [1, 2, 7, 33]


def _randn(*shape, gen, scale=1.0):
    return scale * torch.randn(*shape, generator=gen, dtype=DT)


def _assert_same_fwd_bwd(fast_fn, ref_fn, inputs, seed=0):
    """``fast_fn(*inputs)`` == ``ref_fn(*inputs)`` and their vector-Jacobian products w.r.t. every input."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    fast, ref = fast_fn(*inputs), ref_fn(*inputs)
    torch.testing.assert_close(fast, ref, **TOL)
    cot = torch.randn(fast.shape, generator=torch.Generator().manual_seed(seed), dtype=DT)
    g_fast = torch.autograd.grad((fast * cot).sum(), inputs, allow_unused=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), inputs, allow_unused=True)
    for i, (a, b) in enumerate(zip(g_fast, g_ref)):
        a = torch.zeros_like(inputs[i]) if a is None else a
        b = torch.zeros_like(inputs[i]) if b is None else b
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"input {i}: {m}")
    return fast, g_fast


class _SDPASpy:
    """Records the keyword arguments of every ``scaled_dot_product_attention`` call of a module."""

    def __init__(self, monkeypatch, module):
        self.calls: list[dict] = []
        real = F.scaled_dot_product_attention

        def spy(*args, **kwargs):
            self.calls.append({**kwargs, "shapes": [tuple(a.shape) for a in args]})
            return real(*args, **kwargs)

        monkeypatch.setattr(module.F, "scaled_dot_product_attention", spy)


# ------------------------------------------------------------------------------------ NRGPT
def _nrgpt_weights(kind, H, d, gen):
    alpha = 0.5 + torch.rand(H, generator=gen, dtype=DT)
    if kind == "full":
        return [_randn(H, d, d, gen=gen, scale=0.4)], alpha
    return [_randn(H, 3, d, gen=gen, scale=0.6), _randn(H, 3, d, gen=gen, scale=0.6)], alpha


FNS = {  # kind -> (grad, grad_reference, energy, energy_reference)
    "full": (E.attention_grad, E.attention_grad_reference, E.attention_energy, E.attention_energy_reference),
    "factored": (E.attention_grad_factored, E.attention_grad_factored_reference, E.attention_energy_factored,
                 E.attention_energy_factored_reference),
}


@pytest.mark.parametrize("kind", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
@pytest.mark.parametrize("H", [2, 3])
@pytest.mark.parametrize("N", NS)
def test_nrgpt_fast_update_and_energy_equal_reference_forward_backward(kind, mask, H, N):
    gen = torch.Generator().manual_seed(N * 7 + H)
    d, strict, beta = 5, mask == "strict", 0.8
    weights, alpha = _nrgpt_weights(kind, H, d, gen)
    g, ctx = _randn(3, N, d, gen=gen), _randn(3, N, d, gen=gen)
    grad, grad_ref, energy, energy_ref = FNS[kind]
    force, _ = _assert_same_fwd_bwd(lambda x, a, *w: grad(x, *w, a, beta, strict),
                                    lambda x, a, *w: grad_ref(x, *w, a, beta, strict), [g, alpha, *weights])
    e, _ = _assert_same_fwd_bwd(lambda x, c, a, *w: energy(x, *w, a, beta, strict, context=c),
                                lambda x, c, a, *w: energy_ref(x, *w, a, beta, strict, context=c),
                                [g, ctx, alpha, *weights], seed=1)
    if strict:  # token 0 has no context: exactly zero, as on the reference path
        assert (force[:, 0] == 0).all() and (e[:, 0] == 0).all()
    assert force.abs().max() > 1e-3 or (strict and N == 1)  # not vacuous


@pytest.mark.parametrize("attention", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
@pytest.mark.parametrize("N", NS)
def test_nrgpt_block_fast_equals_use_reference_for_every_parameter(attention, mask, N):
    torch.manual_seed(N)
    blk = NRGPTBlock(6, 2, attention=attention, mask=mask, d_ff=10, head_dim=3, eta_param="diag_lowrank",
                     eta_rank=2).double()
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, N, 6, dtype=DT, requires_grad=True)
    cot = torch.randn(2, N, 6, dtype=DT)
    results = []
    for use_reference in (False, True):
        blk.attention.use_reference = use_reference
        y, en = blk(x), blk.energy(x)["attn"]
        loss = (y * cot).sum() + en.sum()
        results.append((y, en, torch.autograd.grad(loss, [x, *blk.parameters()], allow_unused=True)))
    blk.attention.use_reference = False
    (y0, e0, g0), (y1, e1, g1) = results
    torch.testing.assert_close(y0, y1, **TOL)
    torch.testing.assert_close(e0, e1, **TOL)
    names = ["x", *(n for n, _ in blk.named_parameters())]
    for name, a, b in zip(names, g0, g1):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["full", "factored"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("n_new", [1, 2, 5, 9])
def test_nrgpt_from_keys_equals_reference_rows(kind, strict, n_new):
    """Cached decoding: the last ``n_new`` of 9 positions against every key == the reference's rows."""
    gen = torch.Generator().manual_seed(n_new)
    d, H, S, beta = 5, 2, 9, 0.6
    weights, alpha = _nrgpt_weights(kind, H, d, gen)
    g = _randn(2, S, d, gen=gen)
    if kind == "full":
        keys, q, out = E.attention_keys(g, weights[0]), g[:, None].expand(-1, H, -1, -1), None
    else:
        keys, q, out = E.head_projection(g, weights[1]), E.head_projection(g, weights[0]), weights[0]
    _, grad_ref, _, energy_ref = FNS[kind]
    force = E.attention_force_from_keys(q[:, :, S - n_new:], keys, alpha, beta, strict, out)
    energy = E.attention_energy_from_keys(q[:, :, S - n_new:], keys, alpha, beta, strict)
    torch.testing.assert_close(force, grad_ref(g, *weights, alpha, beta, strict)[:, S - n_new:], **TOL)
    torch.testing.assert_close(energy, energy_ref(g, *weights, alpha, beta, strict)[:, S - n_new:], **TOL)


@pytest.mark.parametrize("attention", ["full", "factored"])
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
def test_nrgpt_training_force_is_one_causal_sdpa_call_without_mask(monkeypatch, attention, mask):
    spy = _SDPASpy(monkeypatch, E)
    blk = NRGPTBlock(8, 2, attention=attention, mask=mask)
    blk(torch.randn(2, 7, 8))
    (call,) = spy.calls
    assert call["is_causal"] is True and "attn_mask" not in call
    n_q = call["shapes"][0][-2]
    assert n_q == (6 if mask == "strict" else 7)  # the strict mask runs on the shifted stream
    spy.calls.clear()
    blk.attention.use_reference = True  # the plain reference does not go through SDPA
    blk(torch.randn(2, 7, 8))
    assert spy.calls == []


def test_nrgpt_strict_single_token_decoding_needs_no_mask(monkeypatch):
    spy = _SDPASpy(monkeypatch, E)
    blk = NRGPTBlock(8, 2, attention="full", mask="strict")
    g = torch.randn(1, 5, 8)
    keys = blk.attention.keys(g)
    blk.attention.grad_from_keys(g[:, -1:], keys)
    (call,) = spy.calls
    assert "attn_mask" not in call and "is_causal" not in call and call["shapes"][1][-2] == 4


# ------------------------------------------------------------------------------------ CEM diag_shared
def _cem_inputs(n, heads, dh, d, gen, s=None):
    s = n if s is None else s
    return (_randn(2, n, d, gen=gen), _randn(2, s, d, gen=gen), _randn(heads * dh, d, gen=gen, scale=1 / math.sqrt(d)),
            _randn(heads * dh, d, gen=gen, scale=1 / math.sqrt(d)), _randn(d, gen=gen, scale=0.5))


def _diag_shared(fn, heads, rope_mode, s_total=None):
    """``(g, h, w_q, w_k, diag) -> ∇_g ε_att`` through ``fn`` (a ``diag_shared_grad_*``); keys and
    values from ``h`` (``S ≥ N`` positions: ``g`` are the last ``N``)."""
    def run(g, h, w_q, w_k, diag):
        n, s, dh = g.shape[1], h.shape[1], w_q.shape[0] // heads
        rope = None
        if rope_mode is not None:
            rope = rope_cos_sin(n, dh, 50.0, dtype=DT, start=s - n)
            rope_k = rope_cos_sin(s, dh, 50.0, dtype=DT)
        ctx = C.interaction_context(h, w_k, heads, rope=None if rope is None else rope_k,
                                    exact_rope=rope_mode != "llama")
        ctx.rope = rope
        return fn(g, ctx, w_q, diag, heads, math.sqrt(dh))
    return run


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("heads,dh,d", [(1, 4, 6), (3, 2, 7), (2, 6, 12)])  # d_h + d: 10, 9, 18 (padded to 8k)
@pytest.mark.parametrize("rope", [None, "exact", "llama"])
def test_cem_diag_shared_sdpa_equals_dense_and_reference_forward_backward(N, heads, dh, d, rope):
    gen = torch.Generator().manual_seed(N + 10 * heads)
    inputs = list(_cem_inputs(N, heads, dh, d, gen))
    fast, _ = _assert_same_fwd_bwd(_diag_shared(C.diag_shared_grad_sdpa, heads, rope),
                                   _diag_shared(C.diag_shared_grad_dense, heads, rope), inputs)
    if N <= 7:  # the O(H N² d²) per-element reference
        g, h, w_q, w_k, diag = inputs
        rope_t = None if rope is None else rope_cos_sin(N, dh, 50.0, dtype=DT)
        ref = C.interaction_grad_reference(g, h, w_q, w_k, heads, diag=diag, rope=rope_t,
                                           exact_rope=rope != "llama")
        torch.testing.assert_close(fast, ref, **TOL)
    assert fast.abs().max() > 1e-3


@pytest.mark.parametrize("n_new", [1, 3])
def test_cem_diag_shared_sdpa_equals_dense_with_cached_context(n_new):
    gen = torch.Generator().manual_seed(n_new)
    inputs = list(_cem_inputs(n_new, 2, 4, 9, gen, s=8))
    _assert_same_fwd_bwd(_diag_shared(C.diag_shared_grad_sdpa, 2, "exact"),
                         _diag_shared(C.diag_shared_grad_dense, 2, "exact"), inputs)


@pytest.mark.parametrize("N", [1, 7])
@pytest.mark.parametrize("interaction", ["diag_shared", "diag_per_head"])
@pytest.mark.parametrize("rows", [None, 2])
def test_cem_layer_diag_shared_sdpa_equals_dense_for_every_parameter(N, interaction, rows, monkeypatch):
    """The layer with its diagonal (shared or per head, RoPE'd keys so values are not the keys)
    forced through SDPA equals the dense scores (to rounding), output and the gradient of every
    parameter; ``rows=2``: the dense path in causal blocks of 2 rows (7 rows: 3 blocks)."""
    if rows is not None:
        monkeypatch.setattr(heads, "CAUSAL_BLOCK_MIN_ROWS", rows)
    torch.manual_seed(0)
    layer = CEMAttention(12, 3, n_steps=2, interaction=interaction, rope="exact",
                         preconditioner="diag_lowrank", preconditioner_rank=2).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, N, 12, dtype=DT, requires_grad=True)
    cot = torch.randn(2, N, 12, dtype=DT)
    out = {}
    for path in ("sdpa", "scores"):
        with force_attention_path(path):
            y = layer(x)
            out[path] = (y, torch.autograd.grad((y * cot).sum(), [x, *layer.parameters()]))
    torch.testing.assert_close(out["sdpa"][0], out["scores"][0], **TOL)
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], out["sdpa"][1], out["scores"][1]):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_cem_diag_shared_sdpa_is_one_causal_call_without_mask(monkeypatch):
    spy = _SDPASpy(monkeypatch, C)
    layer = CEMAttention(16, 2, interaction="diag_shared")
    with force_attention_path("sdpa"):
        layer(torch.randn(2, 5, 16))
    (call,) = spy.calls
    assert call["is_causal"] is True and "attn_mask" not in call
    assert call["shapes"][0] == (2, 2, 5, 24)  # d_h + d = 8 + 16, already a multiple of 8


def test_cem_diag_shared_path_is_chosen_by_device(monkeypatch):
    """``sdpa=None``: the dense scores on the CPU, SDPA on any other device (checked on ``meta``)."""
    chosen = []
    monkeypatch.setattr(C, "diag_shared_grad_sdpa", lambda *a: chosen.append("sdpa"))
    monkeypatch.setattr(C, "diag_shared_grad_dense", lambda *a: chosen.append("dense"))
    for device in ("cpu", "meta"):
        g, w_q = torch.zeros(1, 2, 4, device=device), torch.zeros(4, 4, device=device)
        C.diag_shared_grad(g, None, w_q, None, 1, 1.0)
        C.diag_shared_grad(g, None, w_q, None, 1, 1.0, sdpa=False)
        C.diag_shared_grad(g, None, w_q, None, 1, 1.0, sdpa=True)
    assert chosen == ["dense", "dense", "sdpa", "sdpa", "dense", "sdpa"]


def test_cem_model_diag_shared_sdpa_logits_and_cached_decoding_equal_dense():
    from energyformer import build_model
    from energyformer.layers.cem_options import DiagSharedInteraction
    from energyformer.layers.kv_cache import KVCache

    torch.manual_seed(0)
    model = build_model({"arch": "cem", "vocab_size": 19, "block_size": 16, "d_model": 12, "n_layers": 2,
                         "n_heads": 3, "d_ff": 20, "n_steps": 2, "interaction": "diag_shared",
                         "rope": "exact"}).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    entries = [m for m in model.modules() if isinstance(m, DiagSharedInteraction)]
    assert len(entries) == 2
    idx = torch.randint(0, 19, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = {}
    with torch.no_grad():
        for path in ("scores", "sdpa"):
            with force_attention_path(path):
                logits[path] = model(idx)[0]
        cache, pieces = KVCache(), []
        with force_attention_path("sdpa"):
            for a, b in ((0, 5), (5, 6), (6, 9)):  # prefill, one token, an extension
                pieces.append(model(idx[:, a:b], cache=cache)[0])
    torch.testing.assert_close(logits["sdpa"], logits["scores"], **TOL)
    torch.testing.assert_close(torch.cat(pieces, dim=1), logits["sdpa"], **TOL)


def test_cem_diag_shared_sdpa_attribute_is_deprecated_and_still_forces_the_path(monkeypatch):
    """``DiagSharedInteraction.sdpa`` (documented before 0.3): reading or setting it warns
    (``DeprecationWarning``, naming ``force_attention_path``) and ``True`` / ``False`` / ``None`` still
    choose SDPA / the dense scores / by device, over a forced path, as they did."""
    chosen = []
    monkeypatch.setattr(C, "diag_shared_grad_sdpa", lambda g, *a: chosen.append("sdpa") or torch.zeros_like(g))
    monkeypatch.setattr(C, "diag_shared_grad_dense", lambda g, *a: chosen.append("dense") or torch.zeros_like(g))
    layer = CEMAttention(16, 2, interaction="diag_shared")
    x = torch.randn(1, 3, 16)
    # the entry's value, a path forced around it, the path taken (True / False win over the forced one)
    for value, forced, taken in ((True, "scores", "sdpa"), (False, "sdpa", "dense"), (None, "sdpa", "sdpa")):
        with pytest.warns(DeprecationWarning, match=r"sdpa is deprecated: .*force_attention_path"):
            layer.interaction.sdpa = value
        with pytest.warns(DeprecationWarning, match="force_attention_path"):
            assert layer.interaction.sdpa is value
        chosen.clear()
        with force_attention_path(forced):
            layer(x)
        assert set(chosen) == {taken}, value
    chosen.clear()
    layer(x)  # None, nothing forced: by device (the dense scores on the CPU)
    assert set(chosen) == {"dense"}


# ------------------------------------------------------------------------------------ CEM: folded step map
def _row_map(d, gen):
    """A linear row map ``v ↦ v @ R`` with a differentiable ``R`` (d, d), not symmetric (so a wrong
    side or a transpose shows)."""
    r = _randn(d, d, gen=gen, scale=0.5).requires_grad_(True)
    return r, (lambda v: v @ r)


@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("form", ["lowrank", "shared_dense", "shared_sdpa"])
@pytest.mark.parametrize("rope", [None, "exact", "llama"])
def test_cem_folded_step_map_equals_map_of_gradient_forward_backward(N, form, rope, monkeypatch):
    """``grad(g, fold_step_map(ctx, M))`` == ``M(grad(g, ctx))`` (float64), output and the gradient of
    every input and of ``M`` itself; several causal row blocks at N = 33."""
    monkeypatch.setattr(heads, "CAUSAL_BLOCK_MIN_ROWS", 4)
    gen = torch.Generator().manual_seed(N)
    heads_, dh, d = 2, 4, 9
    g, h, w_q, w_k, diag = (t.requires_grad_(True) for t in _cem_inputs(N, heads_, dh, d, gen))
    r, step_map = _row_map(d, gen)
    rope_t = None if rope is None else rope_cos_sin(N, dh, 50.0, dtype=DT)
    ctx = C.interaction_context(h, w_k, heads_, rope=rope_t, exact_rope=rope != "llama")
    tau = math.sqrt(dh)
    if form == "lowrank":
        def grad(c):
            return C.lowrank_grad(g, c, w_q, heads_, tau)
        folded = C.fold_step_map(ctx, step_map, w_q)
    else:
        fn = C.diag_shared_grad_dense if form == "shared_dense" else C.diag_shared_grad_sdpa

        def grad(c):
            return fn(g, c, w_q, diag, heads_, tau)
        folded = C.fold_step_map(ctx, step_map, w_q, diag)
    assert folded.folded and not ctx.folded
    fast, ref = grad(folded), step_map(grad(ctx))
    torch.testing.assert_close(fast, ref, **TOL)
    assert (fast - grad(ctx)).abs().max() > 1e-2  # the map is not the identity: the test can fail
    cot = torch.randn(fast.shape, generator=gen, dtype=DT)
    inputs = [g, h, w_q, w_k, diag, r]
    g_fast = torch.autograd.grad((fast * cot).sum(), inputs, allow_unused=True, retain_graph=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), inputs, allow_unused=True)
    for name, a, b in zip(["g", "h", "w_q", "w_k", "diag", "R"], g_fast, g_ref):
        if form == "lowrank" and name == "diag":
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_cem_folded_step_map_refuses_what_it_cannot_fold():
    """A per-head diagonal, a context without ĥ, a second fold, and the forms without a folded
    path given a folded context: each a clear ValueError, never a silently unmapped gradient."""
    gen = torch.Generator().manual_seed(0)
    g, h, w_q, w_k, diag = _cem_inputs(5, 2, 4, 8, gen)
    ctx = C.interaction_context(h, w_k, 2)
    step_map = lambda v: 2.0 * v  # noqa: E731
    with pytest.raises(ValueError, match=r"shared diagonal \(d,\)=\(8,\) only; got diag of shape \(2, 8\)"):
        C.fold_step_map(ctx, step_map, w_q, diag.expand(2, 8))
    with pytest.raises(ValueError, match="needs the context's ĥ"):
        C.fold_step_map(C.InteractionContext(None, ctx.k, ctx.v, None), step_map, w_q, diag)
    folded = C.fold_step_map(ctx, step_map, w_q, diag)
    with pytest.raises(ValueError, match="already has a step map folded in"):
        C.fold_step_map(folded, step_map, w_q)
    with pytest.raises(ValueError, match="no diagonal term"):
        C.lowrank_grad(g, folded, w_q, 2, 2.0)
    per_head = diag.expand(2, 8).contiguous()
    for fn in (C.diag_per_head_grad_dense, C.diag_per_head_grad_sdpa):
        with pytest.raises(ValueError, match="takes no folded step map"):
            fn(g, folded, w_q, per_head, 2, 2.0)
    only = C.fold_step_map(C.interaction_context(h, None, 2), step_map, w_q[:, :8], diag)
    with pytest.raises(ValueError, match="takes no folded step map"):
        C.diag_only_grad(g, only, per_head, 2.0)
