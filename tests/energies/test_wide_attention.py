"""Energy attention at head widths the fused CUDA kernels refuse (issue 30; docs/gpu.md, "Wide
attention heads"): NRGPT's full ``J`` (keys ``d`` wide) and CEM's augmented diagonal heads
(``d_h + d`` wide) and diagonal-only heads (``d`` wide) take a path that materializes the scores
in the compute dtype on CUDA; the CPU keeps SDPA.

* the path rule (:func:`energyformer.energies.heads.attention_path`): by width, on CUDA only;
* every materialized path equals the SDPA path and the plain reference in float64, forward and
  backward (w.r.t. inputs and weights), with and without a cache; and within a bf16 tolerance of
  the float64 reference under CPU autocast;
* under ``torch.autocast('cpu', bfloat16)`` every tensor SDPA receives is already bf16 (autocast
  copies nothing, in particular no expanded query) and no ``torch.cat`` promotes to float32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from energyformer.energies import cem as C
from energyformer.energies import heads
from energyformer.energies import nrgpt as E
from energyformer.energies.heads import FUSED_HEAD_DIM_MAX, attention_path, force_attention_path, rope_cos_sin

DT = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def _randn(*shape, gen, scale=1.0, dtype=DT):
    return (scale * torch.randn(*shape, generator=gen, dtype=DT)).to(dtype)


def _same_fwd_bwd(fns, inputs, seed=0, tol=TOL):
    """Every ``fn(*inputs)`` of ``fns`` equals the first one, and so do their VJPs w.r.t. every input."""
    outs = []
    cot = None
    for fn in fns:
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        y = fn(*xs)
        if cot is None:
            cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
        grads = torch.autograd.grad((y * cot).sum(), xs, allow_unused=True)
        outs.append((y, [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)]))
    (y0, g0), rest = outs[0], outs[1:]
    for y, gs in rest:
        torch.testing.assert_close(y, y0, **tol)
        for i, (a, b) in enumerate(zip(gs, g0)):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"input {i}: {m}")
    return y0


def _forced(path, fn):
    def run(*args):
        with force_attention_path(path):
            return fn(*args)
    return run


# ------------------------------------------------------------------------------------ the rule
def test_path_is_chosen_by_width_on_cuda_only():
    assert attention_path(FUSED_HEAD_DIM_MAX, "cuda") == "sdpa"
    assert attention_path(FUSED_HEAD_DIM_MAX + 1, "cuda") == "scores"
    assert attention_path(832, torch.device("cuda", 0)) == "scores"
    assert attention_path(832, "cpu") == "sdpa" and attention_path(832, "meta") == "sdpa"
    with force_attention_path("scores"):
        assert attention_path(8, "cpu") == "scores"
        with force_attention_path("sdpa"):
            assert attention_path(4096, "cuda") == "sdpa"
        assert heads.forced_attention_path() == "scores"
    assert heads.forced_attention_path() is None
    with pytest.raises(ValueError, match="'flash'"):
        with force_attention_path("flash"):
            pass


def test_cem_entries_pick_the_dense_path_for_wide_heads(monkeypatch):
    """The CEM dispatchers ask the rule with the padded augmented width (d_h + d) or d."""
    seen = []

    def rule(width, device):
        seen.append(width)
        return "scores" if width > 16 else "sdpa"

    monkeypatch.setattr(C, "attention_path", rule)
    chosen = []
    for name in ("diag_shared_grad_sdpa", "diag_shared_grad_dense", "diag_per_head_grad_sdpa",
                 "diag_per_head_grad_dense", "diag_only_grad_sdpa", "diag_only_grad_dense"):
        monkeypatch.setattr(C, name, lambda *a, name=name: chosen.append(name))
    for d in (8, 24):
        g, w_q = torch.zeros(1, 2, d, device="meta"), torch.zeros(8, d, device="meta")  # 2 heads of 4
        C.diag_shared_grad(g, None, w_q, None, 2, 1.0)
        C.diag_per_head_grad(g, None, w_q, None, 2, 1.0)
        C.diag_only_grad(g, None, None, 1.0)
    assert seen == [16, 16, 8, 32, 32, 24]  # 4 + 8 → 16 (padded to 8k), 4 + 24 → 32, d for diag_only
    assert chosen == ["diag_shared_grad_sdpa", "diag_per_head_grad_sdpa", "diag_only_grad_sdpa",
                      "diag_shared_grad_dense", "diag_per_head_grad_dense", "diag_only_grad_dense"]


def test_cem_diag_entries_take_the_dense_path_on_the_cpu(monkeypatch):
    """On the CPU both D+LR entries take the materialized scores whatever the width (faster there:
    benchmarks/bench_layers.py); ``force_attention_path`` still picks either."""
    chosen = []
    for name in ("diag_shared_grad_sdpa", "diag_shared_grad_dense", "diag_per_head_grad_sdpa",
                 "diag_per_head_grad_dense"):
        monkeypatch.setattr(C, name, lambda *a, name=name: chosen.append(name))
    g, w_q = torch.zeros(1, 2, 8), torch.zeros(8, 8)
    C.diag_shared_grad(g, None, w_q, None, 2, 1.0)
    C.diag_per_head_grad(g, None, w_q, None, 2, 1.0)
    with force_attention_path("sdpa"):
        C.diag_shared_grad(g, None, w_q, None, 2, 1.0)
        C.diag_per_head_grad(g, None, w_q, None, 2, 1.0)
    assert chosen == ["diag_shared_grad_dense", "diag_per_head_grad_dense", "diag_shared_grad_sdpa",
                      "diag_per_head_grad_sdpa"]


# ------------------------------------------------------------------------------------ NRGPT full J
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("N", [1, 2, 7])
def test_nrgpt_full_scores_path_equals_sdpa_and_reference(strict, N):
    gen = torch.Generator().manual_seed(N + 10 * strict)
    H, d, beta = 3, 5, 0.8
    inputs = [_randn(2, N, d, gen=gen), 0.5 + torch.rand(H, generator=gen, dtype=DT),
              _randn(H, d, d, gen=gen, scale=0.4)]

    def run(fn):
        return lambda g, a, J: fn(g, J, a, beta, strict)

    y = _same_fwd_bwd([run(E.attention_grad_reference), _forced("scores", run(E.attention_grad)),
                       _forced("sdpa", run(E.attention_grad))], inputs)
    assert y.abs().max() > 1e-3 or (strict and N == 1)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("n_new", [1, 3, 8])
def test_nrgpt_full_scores_path_from_cached_keys(strict, n_new):
    """Cached decoding: head-expanded queries of the last ``n_new`` of 8 positions on the scores path."""
    gen = torch.Generator().manual_seed(n_new)
    H, d, S, beta = 2, 4, 8, 0.7
    g, alpha, J = _randn(1, S, d, gen=gen), 0.5 + torch.rand(H, generator=gen, dtype=DT), _randn(H, d, d, gen=gen)
    ref = E.attention_grad_reference(g, J, alpha, beta, strict)[:, S - n_new:]
    keys = E.attention_keys(g, J)
    q = g[:, S - n_new:].unsqueeze(1).expand(-1, H, -1, -1)
    for path in ("scores", "sdpa"):
        with force_attention_path(path):
            got = E.attention_force_from_keys(q, keys, alpha, beta, strict)
        torch.testing.assert_close(got, ref, **TOL)


def test_nrgpt_full_scores_path_with_dropout_is_a_stochastic_force():
    gen = torch.Generator().manual_seed(0)
    g, J, alpha = _randn(2, 6, 4, gen=gen), _randn(2, 4, 4, gen=gen), torch.ones(2, dtype=DT)
    with force_attention_path("scores"):
        torch.manual_seed(1)
        a = E.attention_grad(g, J, alpha, 1.0, True, dropout_p=0.5)
        torch.manual_seed(1)
        b = E.attention_grad(g, J, alpha, 1.0, True, dropout_p=0.5)
        exact = E.attention_grad(g, J, alpha, 1.0, True)
    torch.testing.assert_close(a, b, **TOL)  # same seed, same mask
    assert not torch.allclose(a, exact)


# ------------------------------------------------------------------------------------ CEM
def _cem(fn, heads_, s_len=None, tau=None, rope=None):
    """``(g, h, w_q, w_k, diag) -> fn(g, ctx, …)`` with keys from ``h`` (``g`` the last N positions);
    ``rope`` "exact" or "llama" (RoPE'd keys; "llama": the values are the un-rotated keys, not tied)."""
    def run(g, h, w_q, w_k, diag):
        dh, s = w_q.shape[0] // heads_, h.shape[1]
        tables = None if rope is None else rope_cos_sin(s, dh, 50.0, dtype=h.dtype)
        ctx = C.interaction_context(h, w_k, heads_, rope=tables, exact_rope=rope != "llama")
        if tables is not None:
            ctx.rope = tuple(t[s - g.shape[1]:] for t in tables)  # the queries' positions
        return fn(g, ctx, w_q, diag, heads_, tau or math.sqrt(dh))
    return run


def _cem_inputs(n, heads_, dh, d, gen, s=None, per_head=True, dtype=DT):
    s = s or n
    h = _randn(2, s, d, gen=gen, dtype=dtype)
    g = h[:, s - n:] + _randn(2, n, d, gen=gen, scale=0.3, dtype=dtype)
    diag = _randn(*((heads_, d) if per_head else (d,)), gen=gen, scale=0.5, dtype=dtype)
    return [g, h, _randn(heads_ * dh, d, gen=gen, scale=0.5, dtype=dtype),
            _randn(heads_ * dh, d, gen=gen, scale=0.5, dtype=dtype), diag]


@pytest.mark.parametrize("N", [1, 2, 7])
@pytest.mark.parametrize("heads_,dh,d", [(1, 4, 6), (3, 2, 7)])
def test_cem_diag_per_head_dense_equals_sdpa_and_reference(N, heads_, dh, d):
    gen = torch.Generator().manual_seed(N + heads_)
    inputs = _cem_inputs(N, heads_, dh, d, gen)
    y = _same_fwd_bwd([_cem(C.diag_per_head_grad_sdpa, heads_), _cem(C.diag_per_head_grad_dense, heads_),
                       _forced("scores", _cem(C.diag_per_head_grad, heads_))], inputs)
    g, h, w_q, w_k, diag = inputs
    torch.testing.assert_close(y, C.interaction_grad_reference(g, h, w_q, w_k, heads_, diag=diag), **TOL)


@pytest.mark.parametrize("n_new", [1, 3])
def test_cem_diag_per_head_dense_with_cached_context(n_new):
    gen = torch.Generator().manual_seed(n_new)
    _same_fwd_bwd([_cem(C.diag_per_head_grad_sdpa, 2), _cem(C.diag_per_head_grad_dense, 2)],
                  _cem_inputs(n_new, 2, 4, 9, gen, s=8))


@pytest.mark.parametrize("N", [1, 2, 7])
@pytest.mark.parametrize("n_new", [None, 1, 3])
def test_cem_diag_only_dense_equals_sdpa_and_reference(N, n_new):
    gen = torch.Generator().manual_seed(N)
    heads_, d, tau = 3, 5, 1.3
    g_all, h, _, _, diag = _cem_inputs(N + 3, heads_, 1, d, gen)
    g = g_all[:, -(n_new or N):]                    # the last positions; without a cache, h as long as g
    h = h if n_new else h[:, -N:]

    def run(fn):
        return lambda g, h, diag: fn(g, C.interaction_context(h, None, heads_), diag, tau)

    y = _same_fwd_bwd([run(C.diag_only_grad_sdpa), run(C.diag_only_grad_dense),
                       _forced("scores", run(C.diag_only_grad))], [g, h, diag])
    if not n_new:
        ref = C.interaction_grad_reference(g, h, None, None, heads_, diag=diag, tau=tau)
        torch.testing.assert_close(y, ref, **TOL)


# ------------------------------------------------------------------------------------ bf16
BF16_TOL = dict(atol=3e-2, rtol=3e-2)


def _bf16_vs_float64(fn, inputs):
    """``fn`` under CPU bf16 autocast (fp32 inputs) against ``fn`` in float64: output and input
    gradients within the bf16 tolerance, relative to each tensor's largest entry."""
    results = []
    for dtype, bf16 in ((DT, False), (torch.float32, True)):
        xs = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = fn(*xs)
        cot = torch.linspace(-1, 1, y.numel(), dtype=DT).reshape(y.shape)
        grads = torch.autograd.grad((y.double() * cot).sum(), xs, allow_unused=True)
        results.append([y.double()] + [torch.zeros_like(x, dtype=DT) if g is None else g.double()
                                       for x, g in zip(xs, grads)])
    for i, (lo, hi) in enumerate(zip(results[1], results[0])):
        scale = hi.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(lo / scale, hi / scale, **BF16_TOL, msg=lambda m, i=i: f"tensor {i}: {m}")


def test_bf16_scores_paths_within_tolerance_of_float64():
    gen = torch.Generator().manual_seed(3)
    N, H, d = 24, 2, 16
    g, alpha, J = _randn(2, N, d, gen=gen), 0.5 + torch.rand(H, generator=gen, dtype=DT), _randn(H, d, d, gen=gen,
                                                                                                 scale=0.1)
    with force_attention_path("scores"):
        _bf16_vs_float64(lambda g, a, J: E.attention_grad(g, J, a, 0.5, True), [g, alpha, J])
        inputs = _cem_inputs(N, 2, 8, d, gen)
        _bf16_vs_float64(_cem(C.diag_per_head_grad, 2), inputs)
        inputs[-1] = inputs[-1][0]
        _bf16_vs_float64(_cem(C.diag_shared_grad, 2), inputs)
        _bf16_vs_float64(lambda g, h, diag: C.diag_only_grad(g, C.interaction_context(h, None, 2), diag, 2.0),
                         [inputs[0], inputs[1], _randn(2, d, gen=gen, scale=0.5)])


# ------------------------------------------------------------------------------------ autocast
class _DtypeSpy:
    """Records the dtypes (and strides) of every tensor passed to SDPA and to ``torch.cat``."""

    def __init__(self, monkeypatch):
        self.sdpa: list[list[tuple]] = []
        self.cat: list[list[torch.dtype]] = []
        real_sdpa, real_cat = F.scaled_dot_product_attention, torch.cat

        def sdpa(*args, **kwargs):
            self.sdpa.append([(a.dtype, a.stride()) for a in args[:3]])
            return real_sdpa(*args, **kwargs)

        def cat(tensors, *args, **kwargs):
            self.cat.append([t.dtype for t in tensors])
            return real_cat(tensors, *args, **kwargs)

        for mod in (E, C):
            monkeypatch.setattr(mod.F, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(C.torch, "cat", cat)


@pytest.mark.parametrize("case", ["nrgpt_full", "nrgpt_factored", "cem_lowrank", "cem_diag_shared_sdpa",
                                  "cem_diag_per_head", "cem_diag_only"])
def test_sdpa_receives_bf16_under_cpu_autocast(monkeypatch, case):
    """Under ``torch.autocast('cpu', bfloat16)`` with fp32 weights and states, every SDPA operand is
    already bf16 (autocast would otherwise copy it, and save the copy: for full J an fp32 query
    expanded over heads) and every ``torch.cat`` joins tensors of one dtype (no promotion to fp32)."""
    gen = torch.Generator().manual_seed(0)
    B, N, H, dh, d = 2, 9, 3, 4, 12
    g = torch.randn(B, N, d, generator=gen, requires_grad=True)
    h = torch.randn(B, N, d, generator=gen)
    w_q, w_k = torch.randn(H * dh, d, generator=gen), torch.randn(H * dh, d, generator=gen)
    spy = _DtypeSpy(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if case == "nrgpt_full":
            y = E.attention_grad(g, torch.randn(H, d, d, generator=gen), torch.ones(H), 0.5, True)
        elif case == "nrgpt_factored":
            y = E.attention_grad_factored(g, w_q.view(H, dh, d), w_k.view(H, dh, d), torch.ones(H), 0.5, True)
        elif case == "cem_lowrank":
            y = C.interaction_grad(g, h, w_q, w_k, H)
        elif case == "cem_diag_shared_sdpa":
            y = C.diag_shared_grad(g, C.interaction_context(h, w_k, H), w_q, torch.randn(d), H, 2.0, sdpa=True)
        elif case == "cem_diag_per_head":
            with force_attention_path("sdpa"):  # the CPU takes the materialized scores by default
                y = C.interaction_grad(g, h, w_q, w_k, H, diag=torch.randn(H, d))
        else:
            y = C.interaction_grad(g, h, None, None, H, diag=torch.randn(H, d), tau=2.0)
    y.float().sum().backward()
    assert spy.sdpa, "no SDPA call"
    for call in spy.sdpa:
        assert [dt for dt, _ in call] == [torch.bfloat16] * 3, f"{case}: SDPA got {call}"
    for dtypes in spy.cat:
        assert len(set(dtypes)) == 1, f"{case}: torch.cat of {dtypes} promotes"
    if case == "nrgpt_full":  # the query stays a view of g over heads (stride 0), cast before expanding
        assert spy.sdpa[0][0][1][1] == 0


def test_causal_row_blocks_cover_every_row_and_stop_at_its_last_keys():
    """Blocks tile the query rows in order; a block sees the keys up to its last row's position."""
    for n, s in [(1, 1), (1, 9), (31, 31), (64, 64), (128, 128), (256, 256), (100, 130)]:
        blocks = heads.causal_row_blocks(n, s)
        assert blocks[0][0] == 0 and blocks[-1][1] == n and blocks[-1][2] == s
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        allowed = heads.causal_mask(n, s)
        for r0, r1, keys in blocks:
            assert allowed[r1 - 1, keys - 1] and not allowed[r0:r1, keys:].any()  # nothing seen is cut off
    assert len(heads.causal_row_blocks(128, 128)) == heads.CAUSAL_BLOCKS_MAX
    assert heads.causal_row_blocks(1, 50) == [(0, 1, 50)]  # one decoded token: one block


@pytest.mark.parametrize("rope", [None, "llama"])
@pytest.mark.parametrize("n_new,s_len", [(7, None), (5, 9)])
def test_cem_dense_paths_in_several_causal_blocks_equal_sdpa(monkeypatch, n_new, s_len, rope):
    """The dense diag_shared / diag_per_head paths with the query rows cut into causal blocks (1-row
    minimum, so 7 rows give 4 blocks) equal the SDPA path, full and with a cached context, with
    values that are the keys and (``rope="llama"``) values that are not."""
    monkeypatch.setattr(heads, "CAUSAL_BLOCK_MIN_ROWS", 1)
    assert len(heads.causal_row_blocks(n_new, s_len or n_new)) == 4
    gen = torch.Generator().manual_seed(n_new)
    _same_fwd_bwd([_cem(C.diag_per_head_grad_sdpa, 3, rope=rope), _cem(C.diag_per_head_grad_dense, 3, rope=rope)],
                  _cem_inputs(n_new, 3, 2, 7, gen, s=s_len))
    inputs = _cem_inputs(n_new, 3, 2, 7, gen, s=s_len, per_head=False)
    _same_fwd_bwd([_cem(C.diag_shared_grad_sdpa, 3, rope=rope), _cem(C.diag_shared_grad_dense, 3, rope=rope)],
                  inputs)


@pytest.mark.parametrize("rope", [None, "llama"])
@pytest.mark.parametrize("n_new,s_len", [(5, None), (3, 6)])
def test_cem_diag_per_head_dense_gradcheck_in_several_causal_blocks(monkeypatch, n_new, s_len, rope):
    """``torch.autograd.gradcheck`` (float64) of the dense per-head path's hand-written backward,
    rows in several causal blocks, w.r.t. g, ĥ, W_Q, W_K and the diagonals: tied and separate
    (``rope="llama"``) values, full and with a cached context."""
    monkeypatch.setattr(heads, "CAUSAL_BLOCK_MIN_ROWS", 1)
    assert len(heads.causal_row_blocks(n_new, s_len or n_new)) > 1
    inputs = [t.requires_grad_(True) for t in _cem_inputs(n_new, 2, 2, 3, torch.Generator().manual_seed(n_new),
                                                           s=s_len)]
    assert torch.autograd.gradcheck(_cem(C.diag_per_head_grad_dense, 2, rope=rope), inputs)


@pytest.mark.parametrize("compiled", [False, True])
def test_cem_diag_per_head_dense_when_g_is_the_context(monkeypatch, compiled):
    """At a sub-block's first step ``g`` is ``ĥ``, the same tensor: the dense per-head path does not
    pass it twice to its autograd.Function (``torch.compile(fullgraph=True)`` cannot trace that),
    and its gradient w.r.t. ``ĥ`` sums both roles, equal to the SDPA path's, in several causal blocks."""
    monkeypatch.setattr(heads, "CAUSAL_BLOCK_MIN_ROWS", 1)
    _, h, w_q, w_k, diag = _cem_inputs(7, 3, 2, 7, torch.Generator().manual_seed(5))

    def first_step(fn):
        def run(h, w_q, w_k, diag):
            return _cem(fn, 3)(h, h, w_q, w_k, diag)
        return torch.compile(run, fullgraph=True, backend="eager") if compiled else run

    torch._dynamo.reset()
    _same_fwd_bwd([first_step(C.diag_per_head_grad_sdpa), first_step(C.diag_per_head_grad_dense)],
                  [h, w_q, w_k, diag])


def test_causal_blocks_context_sets_the_blocks_and_restores_them():
    """``causal_blocks(N)``: one row per block (what the benchmark's FLOP count uses), restored after."""
    before = heads.causal_row_blocks(128, 128)
    with heads.causal_blocks(128):
        assert heads.causal_row_blocks(128, 128) == [(i, i + 1, i + 1) for i in range(128)]
    assert heads.causal_row_blocks(128, 128) == before
    with pytest.raises(ValueError, match="max_blocks"):
        with heads.causal_blocks(0):
            pass
