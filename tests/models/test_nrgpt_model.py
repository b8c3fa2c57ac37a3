"""NRGPT model (docs/nrgpt.md §6, docs/testing.md §3, §10): causality for every option and step count, energy
monitoring, inference-time scaling and early stopping, the strict-mask length-1 case, presets,
configuration errors and the parameter counts of docs/nrgpt.md §9 (built on the meta device)."""
import math

import pytest
import torch

from energyformer import build_model
from energyformer.models.nrgpt import NRGPT, NRGPTConfig
from energyformer.models.registry import config_from_dict

V, BLOCK, D = 11, 16, 8




def tiny(seed=0, **kw):
    kw = {"d_model": D, "n_heads": 2, "n_steps": 3, "d_ff": 2 * D, "vocab_size": V, "block_size": BLOCK, **kw}
    model = NRGPT(NRGPTConfig(**kw)).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1)-ish weights so the dynamics are not trivially small
        for name, p in model.named_parameters():
            if name.endswith("c_raw"):
                continue
            if name.endswith(("alpha", "ff_scale")) or name == "step_scales":
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
            elif p.dim() > 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(p.shape[-1]))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def traced(model, idx, targets=None, **kw):
    """``model(idx, targets, **kw)`` under ``model.trace()``: ``(logits, loss, trace)``."""
    with model.trace() as trace:
        logits, loss = model(idx, targets, **kw)
    return logits, loss, trace


OPTIONS = [
    {}, dict(attention="factored"), dict(ff="ff1"), dict(ff="ff2"), dict(mask="inclusive"),
    dict(eta_param="c_diag_gamma"), dict(eta_param="c_identity", norm="rmsnorm"),
    dict(eta_param="psd_plus_skew", norm=None), dict(norm="layernorm_frozen", per_step_scale=True),
    dict(preset="reference"), dict(preset="reference_listops", ff="ff1"), dict(learn_alpha=False, beta=0.5),
]


def manual_forward(model, idx, T):
    """Plain loop: embeddings → T applications of the block (with κ_t) → final LN → head."""
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    states = [x]
    for t in range(T):
        kappa = None if model.step_scales is None else model.step_scales[min(t, model.config.n_steps - 1)]
        x = model.block(x, scale=kappa)
        states.append(x)
    return model.lm_head(model.ln_f(x)), states


@pytest.mark.parametrize("kw", OPTIONS, ids=[str(k) for k in OPTIONS])
def test_causal_every_option_and_step_count(kw):
    model = tiny(**kw)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (2, 12), generator=gen)
    for i in (0, 5):
        idx2 = idx.clone()
        idx2[:, i + 1:] = torch.randint(0, V, idx2[:, i + 1:].shape, generator=gen)
        with torch.no_grad():
            for T in (1, 2, 3, 5):  # 5 > trained n_steps = 3
                _, s1 = manual_forward(model, idx, T)
                _, s2 = manual_forward(model, idx2, T)
                for a, b in zip(s1, s2):  # every intermediate state
                    torch.testing.assert_close(a[:, :i + 1], b[:, :i + 1], atol=1e-12, rtol=0)
                l1, _, e1 = traced(model, idx, n_steps=T)
                l2, _, e2 = traced(model, idx2, n_steps=T)
                torch.testing.assert_close(l1[:, :i + 1], l2[:, :i + 1], atol=1e-12, rtol=0)
                assert not torch.allclose(l1[:, i + 1:], l2[:, i + 1:])
                torch.testing.assert_close(e1.energy("total")[:, :, :i + 1], e2.energy("total")[:, :, :i + 1],
                                           atol=1e-12, rtol=0)
            # early stopping stays causal (token stopping decisions use positions <= itself only)
            l1, _, e1 = traced(model, idx, n_steps=6, stop_tol=1e-2)
            l2, _, e2 = traced(model, idx2, n_steps=6, stop_tol=1e-2)
            torch.testing.assert_close(l1[:, :i + 1], l2[:, :i + 1], atol=1e-12, rtol=0)
            assert torch.equal(e1.steps_taken[:, :i + 1], e2.steps_taken[:, :i + 1])


@pytest.mark.parametrize("kw", [{}, dict(per_step_scale=True, attention="factored")])
def test_energy_trace_matches_manual_loop(kw):
    model = tiny(**kw)
    idx = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, loss, trace = traced(model, idx, idx)
        ref_logits, states = manual_forward(model, idx, 3)
    torch.testing.assert_close(logits, ref_logits, atol=1e-12, rtol=0)
    assert set(trace.terms()) == {"attn", "ff", "total"}
    en = {k: trace.energy(k) for k in ("attn", "ff", "total")}
    assert en["attn"].shape == en["ff"].shape == en["total"].shape == (4, 3, 9)
    # every token got all 3 updates: no stop_tol, so no per-token count; one record per state x⁰ … x³
    assert trace.steps_taken is None and len(trace.records) - 1 == 3
    for t, x in enumerate(states):
        e = model.block.energy(x)
        torch.testing.assert_close(en["attn"][t], e["attn"], atol=1e-12, rtol=0)
        torch.testing.assert_close(en["ff"][t], e["ff"], atol=1e-12, rtol=0)
    torch.testing.assert_close(en["total"], en["attn"] + en["ff"])
    assert not en["total"].requires_grad


def test_energies_cost_nothing_unless_asked(monkeypatch):
    model = tiny()
    calls = []
    orig = model.block.energy
    monkeypatch.setattr(model.block, "energy", lambda x: calls.append(1) or orig(x))
    idx = torch.randint(0, V, (2, 7))
    out = model(idx, idx)
    assert len(out) == 2 and calls == []
    with model.trace():
        out = model(idx)
    assert len(out) == 2 and len(calls) == 4


def test_inference_time_scaling_n_steps_and_generate():
    model = tiny(per_step_scale=True)
    idx = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for T in (1, 2, 7):
            logits, _ = model(idx, n_steps=T)
            torch.testing.assert_close(logits, manual_forward(model, idx, T)[0], atol=1e-12, rtol=0)
        assert not torch.allclose(model(idx, n_steps=7)[0], model(idx)[0])
        # generate passes n_steps to forward: compare with a greedy loop on forward(n_steps=7)
        out = model.generate(idx, max_new_tokens=4, temperature=0.0, n_steps=7)
        ref = idx
        for _ in range(4):
            nxt = model(ref, n_steps=7)[0][:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=1)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="n_steps"):
        model(idx, n_steps=0)
    with pytest.raises(ValueError, match="stop_tol"):
        model(idx, stop_tol=-1e-3)


def reference_stop_rule(model, idx, T, tol):
    """Plain per-token loop of the documented rule: token (b, A) stops updating after the first
    step whose |ΔE_A| < tol; returns logits and the number of updates each token received."""
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    B, N = idx.shape
    frozen = [[False] * N for _ in range(B)]
    steps = torch.zeros(B, N, dtype=torch.long)
    e_old = sum(model.block.energy(x).values())
    for _ in range(T):
        x_step = model.block(x)
        x_new = x.clone()
        for b in range(B):
            for a in range(N):
                if not frozen[b][a]:
                    x_new[b, a] = x_step[b, a]
                    steps[b, a] += 1
        e_new = sum(model.block.energy(x_new).values())
        for b in range(B):
            for a in range(N):
                if abs(float(e_new[b, a] - e_old[b, a])) < tol:
                    frozen[b][a] = True
        x, e_old = x_new, e_new
    return model.lm_head(model.ln_f(x)), steps


def test_early_stopping_rule():
    model = tiny(eta_param="c_diag_gamma", c_init=0.3)
    idx = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base, _ = model(idx, n_steps=12)
        same, _, e0 = traced(model, idx, n_steps=12, stop_tol=0.0)  # |ΔE| < 0 never holds
        torch.testing.assert_close(same, base, atol=0, rtol=0)
        assert torch.equal(e0.steps_taken, torch.full((3, 10), 12))
        # a huge tolerance freezes every token after its first update and ends the loop
        one, _, e1 = traced(model, idx, n_steps=12, stop_tol=1e9)
        torch.testing.assert_close(one, model(idx, n_steps=1)[0], atol=0, rtol=0)
        assert torch.equal(e1.steps_taken, torch.ones(3, 10, dtype=torch.long)) and e1.energy("total").shape[0] == 2
        # an intermediate tolerance: some tokens stop early, others run on; equals the plain rule
        _, _, full = traced(model, idx, n_steps=12)
        tol = float((full.energy("total")[6] - full.energy("total")[5]).abs().median())
        logits, _, en = traced(model, idx, n_steps=12, stop_tol=tol)
        ref_logits, ref_steps = reference_stop_rule(model, idx, 12, tol)
    assert torch.equal(en.steps_taken, ref_steps)
    torch.testing.assert_close(logits, ref_logits, atol=1e-12, rtol=0)
    assert en.steps_taken.min() < 12 and en.steps_taken.float().mean() < 12  # fewer effective steps


def test_strict_mask_length_one_uses_ff_only():
    """Token 0 has no context under the strict mask: zero attention energy and force, FF-only logits."""
    model = tiny()
    idx = torch.randint(0, V, (2, 1))
    with torch.no_grad():
        logits, _, en = traced(model, idx)
        assert logits.shape == (2, 1, V) and torch.isfinite(logits).all()
        assert torch.equal(en.energy("attn"), torch.zeros_like(en.energy("attn")))
        model.block.attention.J.mul_(-3.0)  # attention weights cannot matter for position 0
        torch.testing.assert_close(model(idx)[0], logits, atol=0, rtol=0)
        longer = torch.cat([idx, torch.randint(0, V, (2, 6))], dim=1)
        torch.testing.assert_close(model(longer)[0][:, :1], logits, atol=1e-12, rtol=0)
    # ... but with the inclusive mask token 0 attends to itself
    inc = tiny(mask="inclusive")
    with torch.no_grad():
        e = traced(inc, idx)[2]
    assert e.energy("attn").abs().max() > 0


def test_training_step_learns_and_uses_no_autograd_of_energy(monkeypatch):
    torch.manual_seed(0)
    model = NRGPT(NRGPTConfig(d_model=16, n_heads=2, n_steps=3, vocab_size=V, block_size=BLOCK, dropout=0.1))
    model.train()
    idx = torch.randint(0, V, (4, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def boom(*a, **k):
        raise AssertionError("autograd-of-energy in the training hot path")

    monkeypatch.setattr(torch.autograd, "grad", boom)
    losses = []
    for _ in range(60):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name


def test_config_validation():
    with pytest.raises(ValueError, match="n_steps"):
        NRGPTConfig(n_steps=0)
    with pytest.raises(ValueError, match="n_heads"):
        NRGPTConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="c_init=0.0 must be a finite number > 0 for step map 'c_diag_gamma'"):
        NRGPTConfig(eta_param="c_diag_gamma", c_init=0.0)
    with pytest.raises(ValueError, match="c_init=-0.5 must be a finite number >= 0 for step map 'full'"):
        NRGPTConfig(c_init=-0.5)
    with pytest.raises(ValueError, match="c_diag_gamma"):
        NRGPTConfig(eta_param="c_diag_gamma", norm=None)
    for kw, name in [(dict(ff="mlp"), "ff"), (dict(attention="sparse"), "attention"), (dict(mask="all"), "mask"),
                     (dict(norm="batchnorm"), "norm"), (dict(eta_param="adam"), "eta_param='adam'"),
                     (dict(preset="paper"), "preset"), (dict(beta=-1.0), "beta"),
                     (dict(learn_alpha="yes"), "learn_alpha")]:
        with pytest.raises(ValueError, match=name):
            NRGPTConfig(**kw)
    with pytest.raises(ValueError, match="task"):
        NRGPTConfig.reference("owt")


def test_presets_and_round_trip():
    d = NRGPTConfig()
    assert (d.attention, d.mask, d.norm, d.learn_alpha, d.beta, d.eta_param, d.ff, d.d_ff) == (
        "full", "strict", "layernorm", True, 1.0, "full", "ff2w", 512)
    assert NRGPTConfig(attention="factored", d_model=64, n_heads=4).beta == pytest.approx(0.25)
    ref = NRGPTConfig.reference()
    assert (ref.mask, ref.norm, ref.learn_alpha, ref.beta, ref.attention, ref.eta_param) == (
        "inclusive", "layernorm_frozen", False, 1.0, "full", "full")
    assert NRGPTConfig.reference("listops").mask == "strict"
    assert NRGPTConfig.reference(mask="strict").mask == "strict"  # explicit fields override the preset
    # from YAML / dict, through the registry
    cfg = config_from_dict({"arch": "nrgpt", "preset": "reference", "d_model": 16, "n_heads": 2})
    assert cfg == NRGPTConfig.reference(d_model=16, n_heads=2)
    assert NRGPTConfig.from_dict(cfg.to_dict()) == cfg
    assert NRGPTConfig.from_dict(NRGPTConfig(norm=None, eta_param="psd_plus_skew").to_dict()).norm is None
    model = build_model({"arch": "nrgpt", "preset": "reference", "d_model": 16, "n_heads": 2, "n_steps": 2})
    assert isinstance(model, NRGPT) and model.block.mask == "inclusive" and not model.block.norm.weight.requires_grad


def test_old_step_size_key_maps_to_eta_param_with_warning():
    """Recipes written before the rename: ``step_size`` is read as ``eta_param`` (FutureWarning)."""
    with pytest.warns(FutureWarning, match=r"model\.step_size.*model\.eta_param"):
        cfg = NRGPTConfig.from_dict({"arch": "nrgpt", "d_model": 16, "n_heads": 2, "step_size": "c_identity",
                                     "c_init": 0.2})
    assert cfg == NRGPTConfig(d_model=16, n_heads=2, eta_param="c_identity", c_init=0.2)
    assert "step_size" not in cfg.to_dict() and cfg.to_dict()["eta_param"] == "c_identity"
    with pytest.raises(ValueError, match="eta_param"):  # both spellings of one option
        NRGPTConfig.from_dict({"step_size": "full", "eta_param": "full"})


def _count(cfg):
    with torch.device("meta"):
        return NRGPT(cfg).num_params()


OWT = dict(d_model=768, n_heads=12, n_steps=12, vocab_size=50304, block_size=1024)


def test_parameter_counts_spec():
    """docs/nrgpt.md §9 / docs/testing.md §10 (sum of numel, frozen γ counted; α is fixed in the reference code)."""
    assert _count(NRGPTConfig.reference(**OWT)) == 90_496_897
    assert _count(NRGPTConfig.reference(**OWT, ff="ff1")) == 88_136_833
    mmlu = NRGPTConfig.reference(**{**OWT, "d_model": 1536, "n_steps": 6})
    assert _count(mmlu) == 205_716_097
    with torch.device("meta"):
        m = NRGPT(mmlu)
    head = m.lm_head.weight.numel() + m.lm_head.bias.numel()
    assert m.num_params() - head == 128_398_849
    assert sum(p.numel() for p in m.parameters() if p.requires_grad) == 205_716_097 - 1536  # frozen γ
    # the non-reference default adds the H learnable head weights α; factored J is much smaller
    assert _count(NRGPTConfig(**OWT)) == 90_496_897 + 12
    assert _count(NRGPTConfig(**OWT, attention="factored")) == 90_496_897 + 12 - 12 * 768 ** 2 + 2 * 768 ** 2
    # depth does not change the count (one shared block)
    assert _count(NRGPTConfig.reference(**{**OWT, "n_steps": 3})) == 90_496_897


@pytest.mark.parametrize("ff", ["ff1", "ff2w", "ff2"])
def test_bf16_autocast_trains(ff):
    """Under CPU bf16 autocast (train.dtype=bfloat16) forward/backward run and stay close to float32."""
    torch.manual_seed(0)
    model = NRGPT(NRGPTConfig(d_model=32, n_heads=2, n_steps=2, ff=ff, vocab_size=V, block_size=BLOCK))
    idx = torch.randint(0, V, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16
    for p in model.parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
    assert abs(loss.item() - model(idx, idx)[1].item()) < 2e-2
