"""CEMLlama and CEMConfig (energyformer/models/cem.py): docs/cem.md §8, docs/testing.md §3, §6, §7, §9."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import perturb

from energyformer.models.cem import CEMConfig, CEMLlama
from energyformer.models.config import default_d_ff
from energyformer.models.registry import build_model, config_from_dict, given_fields

V, BLOCK = 19, 12
TINY = dict(vocab_size=V, block_size=BLOCK, d_model=16, n_layers=2, n_heads=2, d_ff=24)
RECIPES = Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char"


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return CEMLlama(CEMConfig(**{**TINY, **kw})).double().eval()


def _option_grid():
    """Every interaction × valid RoPE mode × T ∈ {1, 2, 3}, cycling the other options through all values."""
    precs = [None, "diag", "diag_lowrank", "diag_lowrank_psd"]
    cases = []
    for interaction in ("lowrank", "diag_shared", "diag_per_head", "diag_only"):
        for rope in ((None,) if interaction == "diag_only" else ("exact", "llama", None)):
            for steps in (1, 2, 3):
                i = len(cases)
                cases.append(dict(interaction=interaction, rope=rope, n_steps=steps, preconditioner=precs[i % 4],
                                  preconditioner_rank=2, mlp_tie=("gate", "up")[i % 2],
                                  per_step_scale=(i % 3 == 0), grad_through_norm=(i % 5 == 0),
                                  tie_embeddings=(i % 2 == 1)))
    cases.append(dict(attn_n_steps=3, mlp_n_steps=1, interaction="diag_shared"))
    cases.append(dict(attn_n_steps=1, mlp_n_steps=2, learn_step_size=False, attn_step_size=0.7))
    return cases


GRID = _option_grid()


@pytest.mark.parametrize("kw", GRID, ids=[f"case{i}" for i in range(len(GRID))])
def test_causality_every_option_and_step_count(kw):
    model = perturb(_model(**kw), seed=1)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (2, BLOCK), generator=g)
    with torch.no_grad():
        logits, _ = model(idx)
        for i in (0, 5, BLOCK - 2):
            changed = idx.clone()
            changed[:, i + 1:] = (idx[:, i + 1:] + 1 + torch.randint(0, V - 1, idx[:, i + 1:].shape, generator=g)) % V
            logits2, _ = model(changed)
            torch.testing.assert_close(logits2[:, : i + 1], logits[:, : i + 1], atol=1e-12, rtol=0)
            assert (logits2[:, i + 1:] - logits[:, i + 1:]).abs().max() > 1e-6


@pytest.mark.parametrize("precond", ["diag", "diag_lowrank", "diag_lowrank_psd"])
@pytest.mark.parametrize("steps", [1, 2])
def test_preconditioner_at_init_equals_no_preconditioner(precond, steps):
    plain = _model(n_steps=steps, interaction="diag_shared")
    with_p = _model(n_steps=steps, interaction="diag_shared", preconditioner=precond, preconditioner_rank=3)
    missing, unexpected = with_p.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(".preconditioner." in k for k in missing)
    assert all(k.endswith("step_size") for k in unexpected)
    with torch.no_grad():  # undo the η we just loaded into the fixed η ≡ 1 buffers
        for m in with_p.modules():
            if getattr(m, "preconditioner", None) is not None:
                m.step_size.fill_(1.0)
    idx = torch.randint(0, V, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(with_p(idx)[0], plain(idx)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("interaction", ["diag_shared", "diag_per_head"])
def test_zero_diagonal_at_init_equals_tied_model(interaction):
    plain = _model(n_steps=2)
    dlr = _model(n_steps=2, interaction=interaction)
    missing, unexpected = dlr.load_state_dict(plain.state_dict(), strict=False)
    assert missing == [f"blocks.{i}.attn.interaction.diag" for i in range(2)] and not unexpected
    idx = torch.randint(0, V, (2, BLOCK), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(dlr(idx)[0], plain(idx)[0], atol=1e-12, rtol=0)


def test_forward_is_analytic_no_autograd_needed():
    """The hot path never differentiates an energy: the model runs under inference_mode."""
    model = _model(n_steps=2, interaction="diag_shared", preconditioner="diag_lowrank")
    idx = torch.randint(0, V, (2, BLOCK))
    with torch.inference_mode():
        logits, _ = model(idx)
    assert torch.isfinite(logits).all()


def test_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = CEMLlama(CEMConfig(**{**TINY, "n_steps": 2, "interaction": "diag_shared",
                                  "preconditioner": "diag_lowrank", "preconditioner_rank": 2}))
    idx = torch.randint(0, V, (4, BLOCK), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    for name, p in model.named_parameters():  # every parameter is reached by the loss
        assert p.grad is not None and p.grad.abs().max() > 0, name


def test_trace_reports_every_layer_sub_block_and_step():
    model = _model(attn_n_steps=2, mlp_n_steps=3)
    with torch.no_grad(), model.trace() as trace:
        out = model(torch.randint(0, V, (1, 5)))
    assert len(out) == 2  # the return arity does not change under tracing
    records = trace.records
    assert len(records) == 2 * ((2 + 1) + (3 + 1))
    assert [(e.layer, e.sub, e.step) for e in records[:7]] == (
        [(0, "attn", t) for t in range(3)] + [(0, "mlp", t) for t in range(4)])
    assert trace.layers() == [0, 1] and trace.subs(1) == ["attn", "mlp"]
    assert trace.energy("attn", layer=1).shape == (3, 1, 5) and trace.energy("mlp", layer=0).shape == (4, 1, 5)
    assert records[0].grad.shape == (1, 5, 16) and records[2].grad is None
    assert all(m._trace is None for m in model.modules() if hasattr(m, "_trace"))  # tracing is off again


def test_tie_embeddings_is_one_parameter():
    model = _model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    untied = _model()
    assert untied.num_params() - model.num_params() == V * 16
    assert model.num_params(non_embedding=True) == model.num_params() - V * 16


def test_init_std_and_zero_diagonal():
    torch.manual_seed(0)
    model = CEMLlama(CEMConfig(vocab_size=V, d_model=64, n_layers=1, n_heads=4, interaction="diag_per_head"))
    w = model.blocks[0].attn.q_proj.weight
    assert abs(float(w.detach().std()) - 0.02) < 0.003
    assert bool((model.blocks[0].attn.diag == 0).all())


def test_config_step_shortcut_and_overrides():
    c = CEMConfig(n_steps=3)
    assert (c.attn_n_steps, c.mlp_n_steps) == (3, 3)
    c = CEMConfig(n_steps=3, mlp_n_steps=1)
    assert (c.attn_n_steps, c.mlp_n_steps) == (3, 1)
    model = CEMLlama(CEMConfig(**{**TINY, "n_steps": 2, "mlp_n_steps": 1}))
    assert model.blocks[0].attn.n_steps == 2 and model.blocks[0].mlp.n_steps == 1
    assert CEMConfig.from_dict(c.to_dict()) == c
    assert CEMConfig(d_model=128).d_ff == default_d_ff(128) == 352


def test_registry_builds_cem():
    model = build_model({"arch": "cem", **TINY, "interaction": "diag_shared"})
    assert isinstance(model, CEMLlama) and model.blocks[0].attn.diag.shape == (16,)


@pytest.mark.parametrize("kw,match", [
    (dict(n_steps=0), "n_steps=0"),
    (dict(attn_n_steps=0), "attn_n_steps=0"),
    (dict(n_heads=3), "n_heads=3 must divide d_model=16"),
    (dict(attn_step_size=-1.0), "attn_step_size=-1.0"),
    (dict(interaction="full"), "interaction='full'"),
    (dict(rope="compat"), "rope='compat'"),
    (dict(head_dim=5), "head_dim=5 must be even"),
    (dict(interaction="diag_only"), "diag_only"),
    (dict(mlp_tie="down"), "mlp_tie='down'"),
    (dict(preconditioner="lowrank"), "preconditioner='lowrank'"),
    (dict(preconditioner="diag", mlp_step_size=0.5), "must be None with a preconditioner"),
    (dict(preconditioner_rank=0), "preconditioner_rank=0"),
])
def test_config_bad_values_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        CEMConfig(**{**TINY, **kw})


def test_config_unknown_key_raises():
    with pytest.raises(ValueError, match="unknown model config key"):
        CEMConfig.from_dict({"arch": "cem", "n_step": 2})


def test_odd_head_dim_allowed_without_rope():
    model = CEMLlama(CEMConfig(**{**TINY, "n_heads": 1, "head_dim": 5, "rope": None}))
    assert model(torch.randint(0, V, (1, 4)))[0].shape == (1, 4, V)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("cem*.yaml")) + sorted(RECIPES.glob("llama.yaml")),
                         ids=lambda p: p.name)
def test_recipes_build(path):
    """Every CEM ablation recipe (base: cem.yaml plus its option) differs from cem.yaml's model by
    exactly the option it studies, and shares its size, data and schedule (equal token budgets)."""
    from energyformer.runs.config import load_config
    from energyformer.runs.recipe import read_recipe

    run = load_config(path, resolve_vocab=True, default_vocab_size=65)
    base = load_config(RECIPES / "cem.yaml", resolve_vocab=True, default_vocab_size=65)
    cfg = dataclasses.replace(run.model, vocab_size=65)
    assert cfg == config_from_dict({"vocab_size": 65, **read_recipe(path)["model"]})
    assert cfg.arch in ("cem", "llama") and cfg.d_model == 128 and cfg.n_heads == 4 and cfg.n_layers == 4
    assert run.train.out_dir == f"out/{path.stem}"
    assert dataclasses.replace(run.train, out_dir="x") == dataclasses.replace(base.train, out_dir="x")
    if cfg.arch == "cem":
        a, b = given_fields(cfg), given_fields(dataclasses.replace(base.model, vocab_size=65))
        changed = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert len(changed) <= 4, changed  # the option(s) under study only (attn/mlp_n_steps follow n_steps)


def test_diag_only_heads_start_and_stay_different():
    """Zero per-head diagonals would get equal gradients for ever (no low-rank term breaks the symmetry)."""
    torch.manual_seed(0)
    model = _model(interaction="diag_only", rope=None)
    diag = model.blocks[0].attn.diag
    assert (diag[0] - diag[1]).abs().max() > 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, V, (4, BLOCK), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    assert (diag[0] - diag[1]).abs().max() > 1e-3


@pytest.mark.parametrize("kw", [dict(), dict(preconditioner="diag_lowrank", preconditioner_rank=2)])
def test_n_steps_at_call_time_runs_that_recursion_in_every_sub_block(kw):
    """model(idx, n_steps=K) is the model configured with T = K, holding the same weights."""
    trained = perturb(_model(n_steps=2, interaction="diag_shared", **kw), seed=1)
    deeper = _model(n_steps=4, interaction="diag_shared", **kw)
    deeper.load_state_dict(trained.state_dict())
    idx = torch.randint(0, V, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(trained(idx, n_steps=4)[0], deeper(idx)[0], rtol=0, atol=0)
    torch.testing.assert_close(trained(idx, n_steps=2)[0], trained(idx)[0], rtol=0, atol=0)
    # generation with a cache: the keys/values are computed once per sub-block, whatever the steps
    cached = trained.generate(idx[:1, :4], 6, temperature=0, n_steps=4)
    assert cached.tolist() == trained.generate(idx[:1, :4], 6, temperature=0, n_steps=4, use_cache=False).tolist()
    assert cached.tolist() == deeper.generate(idx[:1, :4], 6, temperature=0).tolist()


def test_n_steps_at_call_time_with_per_step_factors_is_at_most_the_trained_depth():
    model = _model(n_steps=3, per_step_scale=True)
    idx = torch.randint(0, V, (1, 5))
    model(idx, n_steps=2)
    with pytest.raises(ValueError, match=r"n_steps=4 exceeds the 3 per-step factors"):
        model(idx, n_steps=4)
    with pytest.raises(ValueError, match="n_steps=0 must be >= 1"):
        model(idx, n_steps=0)
