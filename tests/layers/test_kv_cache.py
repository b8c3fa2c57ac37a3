"""Cached decoding (docs/architecture.md §5): logits with a key/value cache equal the uncached
forward on the whole sequence, token by token (fp32, 1e-5), for every family and every option
that changes the attention path. The option lists are read from the registries, so a newly
registered entry is covered by being registered.
"""
import pytest
import torch

from energyformer import build_model
from energyformer.layers.cem_options import INTERACTIONS, MLP_TIES
from energyformer.layers.kv_cache import KVCache
from energyformer.layers.norms import NORMS
from energyformer.layers.nrgpt_options import FF_ENERGIES, NRGPT_ATTENTIONS
from energyformer.layers.step_maps import STEP_MAPS
from energyformer.models import ARCHS

V, BLOCK, D = 23, 24, 16
NOT_LANGUAGE_MODELS = {"regressor"}  # continuous inputs, no generation
TOL = dict(atol=1e-5, rtol=1e-5)


def _model(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "block_size": BLOCK, **cfg}).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move every parameter off its init (zero diagonals, identity maps)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _ids(n=14, b=2, seed=3):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


CHUNKS = (5, 3, 1, 1, 2, 1, 1)  # a prefill, a multi-token extension, then single tokens


def _assert_cached_equals_uncached(model, make_cache=KVCache, tol=TOL, **kw):
    idx = _ids(sum(CHUNKS))
    with torch.no_grad():
        full, _ = model(idx, **kw)
        cache, pos = make_cache(), 0
        for n in CHUNKS:
            out, _ = model(idx[:, pos:pos + n], cache=cache, **kw)
            assert out.shape == (2, n, V)
            torch.testing.assert_close(out, full[:, pos:pos + n], **tol)
            pos += n
    assert cache.get_seq_length(0) == pos


# ------------------------------------------------------------------------------------------ cases
def _cem_cases():
    base = dict(arch="cem", d_model=D, n_layers=2, n_heads=2, d_ff=24)
    for name in INTERACTIONS.names():
        cls = INTERACTIONS.get(name)
        for rope in ((None,) if not cls.has_lowrank else ("exact", "llama", None)):
            yield f"cem-{name}-rope_{rope}", {**base, "interaction": name, "rope": rope}
            yield f"cem-{name}-rope_{rope}-T2-3", {**base, "interaction": name, "rope": rope, "attn_n_steps": 2,
                                                   "mlp_n_steps": 3, "per_step_scale": True}
        # n_heads does not divide d_model: the cached ĥ is repeated per head, not split
        yield f"cem-{name}-H3", {**base, "interaction": name, "n_heads": 3, "head_dim": 4,
                                 "rope": None if not cls.has_lowrank else "exact"}
    for name in STEP_MAPS:
        yield f"cem-precond_{name}-T2", {**base, "n_steps": 2, "interaction": "diag_shared",
                                        "preconditioner": name, "preconditioner_rank": 2}
    for name in MLP_TIES:
        yield f"cem-mlp_tie_{name}-grad_through_norm", {**base, "mlp_tie": name, "grad_through_norm": True}


def _nrgpt_cases():
    base = dict(arch="nrgpt", d_model=D, n_heads=2, n_steps=3, d_ff=24, eta_rank=3)
    for att in NRGPT_ATTENTIONS:
        for mask in ("strict", "inclusive"):
            yield f"nrgpt-{att}-{mask}", {**base, "attention": att, "mask": mask}
            yield f"nrgpt-{att}-{mask}-fixed_alpha-beta", {**base, "attention": att, "mask": mask,
                                                           "learn_alpha": False, "beta": 0.37}
    for ff in FF_ENERGIES:
        yield f"nrgpt-ff_{ff}", {**base, "ff": ff}
    for eta in STEP_MAPS:
        yield f"nrgpt-eta_{eta}", {**base, "eta_param": eta, "per_step_scale": True}
    for norm in NORMS:
        eta = "c_identity" if norm in (None, "none") else "full"
        yield f"nrgpt-norm_{norm}", {**base, "norm": norm, "eta_param": eta}
    yield "nrgpt-reference", {**base, "preset": "reference"}


CASES = {
    "gpt": dict(arch="gpt", d_model=D, n_layers=2, n_heads=2),
    "gpt-tied-gelu": dict(arch="gpt", d_model=D, n_layers=2, n_heads=4, tie_embeddings=True, activation="gelu"),
    "llama": dict(arch="llama", d_model=D, n_layers=2, n_heads=2, d_ff=24),
    "llama-gqa": dict(arch="llama", d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24),
    "gpt_rec": dict(arch="gpt_rec", d_model=D, n_heads=2, n_steps=3),
    "gpt_rec_parallel": dict(arch="gpt_rec", d_model=D, n_heads=2, n_steps=3, parallel=True),
    **dict(_cem_cases()),
    **dict(_nrgpt_cases()),
}


def test_every_language_model_family_is_covered():
    assert {c["arch"] for c in CASES.values()} == set(ARCHS) - NOT_LANGUAGE_MODELS


@pytest.mark.parametrize("cfg", CASES.values(), ids=CASES.keys())
def test_cached_logits_equal_uncached(cfg):
    _assert_cached_equals_uncached(_model(cfg))


@pytest.mark.parametrize("arch,cfg", [("nrgpt", CASES["nrgpt-full-strict"]),
                                      ("nrgpt", CASES["nrgpt-factored-inclusive"]), ("gpt_rec", CASES["gpt_rec"])])
def test_recurrent_models_with_other_n_steps_than_trained(arch, cfg):
    model = _model(cfg)
    for n_steps in (1, 7):
        _assert_cached_equals_uncached(model, n_steps=n_steps)


@pytest.mark.parametrize("mask", ["strict", "inclusive"])
def test_nrgpt_stop_tol_with_cache(mask):
    """Per-token early stopping with a cache: every token frozen by the same rule, against the states
    its context had at each step (float64: the rule is a threshold, so fp32 rounding could flip it)."""
    model = _model({**CASES[f"nrgpt-full-{mask}"], "eta_param": "c_diag_gamma"}, torch.float64)
    idx = _ids(sum(CHUNKS))
    with torch.no_grad(), model.trace() as trace:
        model(idx, n_steps=8, stop_tol=0.0)
    steps = trace.energy("total")
    tol = float((steps[1:] - steps[:-1]).abs().median())
    with torch.no_grad(), model.trace() as trace:
        model(idx, n_steps=8, stop_tol=tol)
    taken = trace.steps_taken
    assert int(taken.min()) < int(taken.max()), "tokens must stop at different steps for this test to mean anything"
    _assert_cached_equals_uncached(model, tol=dict(atol=1e-12, rtol=0), n_steps=8, stop_tol=tol)


def test_nrgpt_cache_refuses_other_n_steps_or_stop_tol():
    model = _model(CASES["nrgpt-full-strict"])
    cache = KVCache()
    with torch.no_grad():
        model(_ids(4), cache=cache, n_steps=3)
        with pytest.raises(ValueError, match="filled with n_steps=3, stop_tol=None; got n_steps=5"):
            model(_ids(1), cache=cache, n_steps=5)
        with pytest.raises(ValueError, match="got n_steps=3, stop_tol=0.1"):
            model(_ids(1), cache=cache, n_steps=3, stop_tol=0.1)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "gpt_rec", "cem-diag_per_head-rope_exact",
                                  "cem-diag_shared-rope_llama", "cem-diag_only-rope_None", "nrgpt-factored-strict"])
def test_a_transformers_dynamic_cache_works_too(name):
    """The cache protocol is transformers' ``Cache``: a ``DynamicCache`` can be passed instead."""
    transformers = pytest.importorskip("transformers")
    _assert_cached_equals_uncached(_model(CASES[name]), make_cache=transformers.DynamicCache)


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt_rec", "cem-lowrank-rope_exact", "nrgpt-full-strict"])
def test_cache_past_block_size_is_a_clear_error(name):
    model = _model(CASES[name])
    cache = KVCache()
    with torch.no_grad():
        model(_ids(BLOCK - 1), cache=cache)
        model(_ids(1), cache=cache)
        with pytest.raises(ValueError, match=f"sequence length {BLOCK + 1} \\({BLOCK} cached \\+ 1 new\\) exceeds "
                                             f"block_size={BLOCK}"):
            model(_ids(1), cache=cache)


@pytest.mark.parametrize("name", ["cem-diag_shared-rope_exact", "nrgpt-full-inclusive"])
def test_tracing_with_a_cache_is_refused_and_generate_falls_back(name):
    model = _model(CASES[name])
    idx = _ids(4)
    with model.trace() as trace, torch.no_grad():
        with pytest.raises(ValueError, match="tracing records whole sequences"):
            model(idx, cache=KVCache())
        out = model.generate(idx, 3, temperature=0.0)  # use_cache=True by default: falls back, still traced
    assert out.shape == (2, 7) and len(trace.records) > 0
    torch.testing.assert_close(out, model.generate(idx, 3, temperature=0.0, use_cache=False), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ generate
GEN_CASES = ["gpt", "llama-gqa", "gpt_rec", "cem-diag_shared-rope_exact-T2-3", "cem-precond_diag_lowrank-T2",
             "nrgpt-full-strict", "nrgpt-factored-inclusive"]


def _greedy_reference(model, idx, n_new, **kw):
    """The documented context rule of cached generation, written with uncached forwards: the cache
    starts on the last ``block_size`` prompt tokens and, once full, restarts on the last
    ``block_size − block_size // 4`` tokens."""
    block = model.config.block_size
    keep = max(1, block - max(1, block // 4))
    seq, start = idx, max(0, idx.shape[1] - block)
    for _ in range(n_new):
        if seq.shape[1] - start > block:
            start = seq.shape[1] - keep
        logits, _ = model(seq[:, start:], **kw)
        seq = torch.cat((seq, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq


@pytest.mark.parametrize("name", GEN_CASES)
def test_generate_with_cache_equals_without_within_block_size(name):
    model = _model(CASES[name])
    idx = _ids(5)
    with torch.no_grad():
        cached = model.generate(idx, BLOCK - 5, temperature=0.0)
        plain = model.generate(idx, BLOCK - 5, temperature=0.0, use_cache=False)
    assert torch.equal(cached, plain)
    g1, g2 = (torch.Generator().manual_seed(7) for _ in range(2))
    sampled = model.generate(idx, BLOCK - 5, temperature=1.0, top_k=10, generator=g1)
    assert torch.equal(sampled, model.generate(idx, BLOCK - 5, temperature=1.0, top_k=10, generator=g2,
                                               use_cache=False))


@pytest.mark.parametrize("name", GEN_CASES)
def test_generate_past_block_size_restarts_the_cache_as_documented(name):
    model = _model(CASES[name])
    for n_prompt in (5, BLOCK + 3):  # a short prompt, and one longer than the context
        idx = _ids(n_prompt)
        with torch.no_grad():
            out = model.generate(idx, 2 * BLOCK + 3, temperature=0.0)
            assert torch.equal(out, _greedy_reference(model, idx, 2 * BLOCK + 3))


def test_generate_passes_n_steps_and_stop_tol_with_the_cache():
    model = _model({**CASES["nrgpt-full-strict"], "eta_param": "c_diag_gamma"})
    idx = _ids(4)
    with torch.no_grad():
        for kw in (dict(n_steps=6), dict(n_steps=6, stop_tol=1e-3)):
            out = model.generate(idx, 10, temperature=0.0, **kw)
            assert torch.equal(out, model.generate(idx, 10, temperature=0.0, use_cache=False, **kw))


# ------------------------------------------------------------------------------------------ the cache object
def test_kv_cache_grows_and_checks_shapes():
    cache = KVCache()
    assert cache.get_seq_length() == 0 and len(cache) == 0
    chunks = [torch.randn(2, 3, n, 4) for n in (5, 20, 1)]
    for c in chunks:
        k, v = cache.update(c, c[..., :0], layer_idx=1)
    torch.testing.assert_close(k, torch.cat(chunks, dim=2), rtol=0, atol=0)
    assert v.shape == (2, 3, 26, 0) and cache.get_seq_length(1) == 26 and cache.get_seq_length(0) == 0
    assert len(cache) == 2
    with pytest.raises(ValueError, match=r"slot 1 holds \(B, H, e\) = \(2, 3, 4\).*cannot append \(2, 5, 1, 4\)"):
        cache.update(torch.randn(2, 5, 1, 4), torch.randn(2, 5, 1, 4), layer_idx=1)
    with pytest.raises(ValueError, match=r"\(B, H, N, e\)"):
        cache.update(torch.randn(3, 1, 4), torch.randn(3, 1, 4), layer_idx=0)
    cache.crop(10)
    assert cache.get_seq_length(1) == 10
    k, _ = cache.update(chunks[2], chunks[2][..., :0], layer_idx=1)
    torch.testing.assert_close(k[:, :, 10], chunks[2][:, :, 0], rtol=0, atol=0)
    cache.reset()
    assert len(cache) == 0 and cache.get_seq_length(1) == 0
