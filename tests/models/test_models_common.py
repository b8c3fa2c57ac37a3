"""Properties every architecture must have: causality, bad-input errors, generate, ids → logits shapes."""
import pytest
import torch
from helpers import perturb

from energyformer import build_model
from energyformer.layers.trace import tracing
from energyformer.models import ARCHS

V, BLOCK = 23, 16

TINY = {
    "gpt": [dict(d_model=16, n_layers=2, n_heads=2)],
    "llama": [dict(d_model=16, n_layers=2, n_heads=2, d_ff=24),
              dict(d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)],
    "gpt_rec": [dict(d_model=16, n_heads=2, n_steps=3, parallel=False),
                dict(d_model=16, n_heads=2, n_steps=3, parallel=True)],
    "nrgpt": [dict(d_model=16, n_heads=2, n_steps=3),
              dict(d_model=16, n_heads=2, n_steps=2, ff="ff1", mask="inclusive")],
    "cem": [dict(d_model=16, n_layers=2, n_heads=2, d_ff=24),
            dict(d_model=16, n_layers=1, n_heads=2, d_ff=24, n_steps=2, interaction="diag_shared",
                 preconditioner="diag_lowrank", preconditioner_rank=2)],
}
CASES = [(arch, kw) for arch, kws in TINY.items() for kw in kws]
IDS = [f"{a}-{i}" for a, kws in TINY.items() for i in range(len(kws))]


def make(arch, kw):
    torch.manual_seed(0)
    model = build_model({"arch": arch, "vocab_size": V, "block_size": BLOCK, **kw})
    return model.eval()


# arch "regressor" reads continuous values, not token ids: its causality is tested in tests/data/test_tasks.py
NOT_TOKEN_MODELS = {"regressor"}
CONFIG_ONLY = {"regressor": [dict(d_model=16, n_layers=2, n_heads=2)]}  # for the config checks below


def test_every_registered_arch_is_covered():
    assert set(TINY) == set(ARCHS) - NOT_TOKEN_MODELS


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_causality(arch, kw):
    model = make(arch, kw)
    perturb(model, seed=1)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (2, BLOCK), generator=g)
    logits, _ = model(idx)
    for i in (0, 5, BLOCK - 2):
        changed = idx.clone()
        changed[:, i + 1:] = torch.randint(0, V, changed[:, i + 1:].shape, generator=g)
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, : i + 1], logits[:, : i + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2[:, i + 1:], logits[:, i + 1:])  # later positions do see the change


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_shapes_loss_and_generate(arch, kw):
    model = make(arch, kw)
    idx = torch.randint(0, V, (3, 7))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (3, 7, V)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(float(V))).item()) < 1.0  # near uniform at init
    out = model.generate(idx[:, :2], max_new_tokens=BLOCK + 3, temperature=0.8, top_k=5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 2 + BLOCK + 3)
    assert int(out.min()) >= 0 and int(out.max()) < V
    greedy1 = model.generate(idx[:, :2], max_new_tokens=4, temperature=0.0)
    greedy2 = model.generate(idx[:, :2], max_new_tokens=4, temperature=0.0)
    assert torch.equal(greedy1, greedy2)


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_bad_input_is_a_clear_error(arch, kw):
    model = make(arch, kw)
    with pytest.raises(ValueError, match=rf"token id {V} is out of range.*\[0, {V}\)"):
        model(torch.tensor([[0, 1, V]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match=f"sequence length {BLOCK + 1} exceeds block_size={BLOCK}"):
        model(torch.zeros(1, BLOCK + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype torch.float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"shape \(B, N\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1, temperature=-0.5)


ENERGY_ARCHS = {"nrgpt", "cem"}


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_tracing_keeps_the_return_pair_or_refuses(arch, kw):
    """Energy models record a trace and still return ``(logits, loss)``; the others cannot be traced."""
    model = make(arch, kw)
    idx = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    if arch not in ENERGY_ARCHS:
        for open_trace in (model.trace, lambda: tracing(model)):
            with pytest.raises(ValueError, match="no energy layers to trace"):
                with open_trace():
                    pass
        return
    with torch.no_grad():
        plain = model(idx, targets=idx)
        with model.trace() as trace:
            out = model(idx, targets=idx)
            assert len(model(idx)) == 2
    assert len(out) == 2 and len(trace.records) > 0
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], plain[1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_invalid_config_values(arch):
    base = {"arch": arch, "vocab_size": V, "block_size": BLOCK, **{**TINY, **CONFIG_ONLY}[arch][0]}
    with pytest.raises(ValueError, match="unknown model config key"):
        build_model({**base, "d_modle": 32})
    with pytest.raises(ValueError, match="n_heads=3 must divide d_model=16"):
        build_model({**base, "n_heads": 3})
    with pytest.raises(ValueError, match="vocab_size=0"):
        build_model({**base, "vocab_size": 0})
    with pytest.raises(ValueError, match="model.arch='nope'"):
        build_model({**base, "arch": "nope"})


def test_gpt_parameter_count_matches_reference_code():
    """docs/nrgpt.md §9: GPT 12L at d=768, H=12, V=50304, block 1024 with untied head = 163,132,032."""
    with torch.device("meta"):
        m = build_model({"arch": "gpt", "vocab_size": 50304, "block_size": 1024, "d_model": 768,
                         "n_layers": 12, "n_heads": 12})
    assert m.num_params() == 163_132_032
    assert m.num_params(non_embedding=True) == 163_132_032 - 50304 * 768 - 1024 * 768


@pytest.mark.parametrize("arch,kw", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
def test_bad_targets_and_generate_guards(arch, kw):
    model = make(arch, kw)
    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"target id {V} is out of range"):
        model(idx, targets=torch.tensor([[1, 2, V]]))
    with pytest.raises(ValueError, match="target id -5"):
        model(idx, targets=torch.tensor([[1, -5, 2]]))
    model(idx, targets=torch.tensor([[1, -1, 2]]))  # -1 = ignored position
    with pytest.raises(ValueError, match="targets must be a torch.long"):
        model(idx, targets=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="dtype torch.uint8"):
        model(torch.zeros(1, 3, dtype=torch.uint8))
    model(torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="token id"):  # checked even when nothing is generated
        model.generate(torch.tensor([[V + 1]]), max_new_tokens=0)
    out = model.generate(idx, max_new_tokens=30, temperature=5.0, vocab_limit=3,
                         generator=torch.Generator().manual_seed(0))
    assert int(out.max()) < 3
    with pytest.raises(ValueError, match="vocab_limit"):
        model.generate(idx, max_new_tokens=1, vocab_limit=V + 1)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite logits"):
        model.generate(idx, max_new_tokens=1)


@pytest.mark.parametrize("arch", ["nrgpt", "gpt", "gpt_rec", "llama", "cem"])
def test_build_model_overrides_rederive_the_derived_fields(arch):
    """Issue 28 item 2: ``build_model(cfg, d_model=128)`` gives the config a fresh ``d_model=128`` config
    would have (``d_ff``, ``head_dim`` derived again), while a value given explicitly stays."""
    from energyformer.models.registry import build_model, config_from_dict

    small = config_from_dict({"arch": arch, "vocab_size": 65, "d_model": 64, "n_heads": 4})
    fresh = config_from_dict({"arch": arch, "vocab_size": 65, "d_model": 128, "n_heads": 4})
    got = build_model(small, d_model=128).config
    assert got.to_dict() == fresh.to_dict()
    explicit = config_from_dict({"arch": arch, "vocab_size": 65, "d_model": 64, "n_heads": 4, "d_ff": 100})
    assert build_model(explicit, d_model=128).config.d_ff == 100


RECURRENT_CASES = [(a, kw) for a, kw in CASES if a in ("gpt_rec", "nrgpt", "cem") and not kw.get("per_step_scale")]


@pytest.mark.parametrize("arch,kw", RECURRENT_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(RECURRENT_CASES)])
def test_causality_at_another_depth_and_with_truncated_backprop(arch, kw):
    """The call-time options of the recurrent families (``n_steps`` other than trained, and
    ``backprop_steps``, which must not change the forward) keep every model causal."""
    model = make(arch, kw)
    perturb(model, seed=1)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (2, BLOCK), generator=g)
    logits, _ = model(idx, n_steps=4)
    truncated, _ = model(idx, n_steps=4, backprop_steps=1)
    torch.testing.assert_close(truncated, logits, rtol=0, atol=1e-6)  # the forward is the same
    for i in (0, BLOCK - 2):
        changed = idx.clone()
        changed[:, i + 1:] = torch.randint(0, V, changed[:, i + 1:].shape, generator=g)
        logits2, _ = model(changed, n_steps=4, backprop_steps=1)
        torch.testing.assert_close(logits2[:, : i + 1], logits[:, : i + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2[:, i + 1:], logits[:, i + 1:])
