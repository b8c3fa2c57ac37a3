"""The papers' protocols as GPU profiles (energyformer.experiments.profiles): every run builds (on
the meta device, no weights allocated), its parameter count is the paper's, its token budget is
the protocol's, and every recipe trains a few steps at a tiny width on the CPU."""
import math

import numpy as np
import pytest
from helpers import make_data_dir

from energyformer.experiments.profiles import LISTOPS_WIDTHS, ProfileRun, chinchilla_steps, pack, profile_runs, profiles
from energyformer.models.accounting import parameter_counts
from energyformer.train import train

EXPERIMENTS = ("listops_transition", "cem_ablation", "nrgpt_owt")


@pytest.fixture(scope="module")
def counts():
    """Parameter counts of every run (models built on torch's meta device)."""
    return {e: {r.name: r.parameters() for r in profile_runs(e)} for e in EXPERIMENTS}


def test_profiles_list_and_errors():
    assert profiles() == {e: ["paper"] for e in sorted(EXPERIMENTS)}
    for e in EXPERIMENTS:
        names = [r.name for r in profile_runs(e)]
        assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="has no profiles"):
        profile_runs("gp_recursion")
    with pytest.raises(ValueError, match="profile 'cpu' is not valid"):
        profile_runs("cem_ablation", "cpu")
    with pytest.raises(ValueError, match="section.key"):
        ProfileRun("x", "configs/paper/owt/gpt.yaml", {"d_model": 8}).recipe_dict()


def test_listops_profile_is_the_reference_sweep(counts):
    """NRGPT paper §ListOps / released sweep LOPS00: 16 widths × 3 models × 100k iterations."""
    runs = profile_runs("listops_transition")
    assert LISTOPS_WIDTHS == tuple(np.int16(np.logspace(3, 8, 16, base=2)).tolist()[::-1])
    assert len(runs) == 48 and {r.group for r in runs} == {"GPT_Rec_parallel", "NRGPT_FF1", "NRGPT_FF2W"}
    assert sorted(r.overrides["model.d_model"] for r in runs) == sorted(LISTOPS_WIDTHS * 3)
    assert all(list(r.overrides) == ["model.d_model"] for r in runs)
    for r in [r for r in runs if r.name.endswith("_d64")]:  # the full validated config, once per model
        cfg = r.load_config()
        tc, m = cfg.train, cfg.model
        assert (tc.max_steps, tc.lr_decay_steps, tc.batch_size, m.block_size) == (100_000, 100_000, 64, 128)
        assert (tc.learning_rate, tc.min_lr, tc.lr_schedule, tc.weight_decay) == (5e-4, 2e-5, "exponential", 0.01)
        assert (m.n_heads, m.n_steps, m.vocab_size) == (1, 5, 17)
        assert r.evals[0]["n_test"] == 100  # the reference scores 100 test problems
    # the sweep brackets the paper's >= 80% transitions (2.3e4 GPT_Rec_parallel … 2.98e4 FF2W),
    # and each model's count grows with its width
    for label, paper in (("GPT_Rec_parallel", 2.3e4), ("NRGPT_FF1", 2.4e4), ("NRGPT_FF2W", 2.98e4)):
        by_width = [counts["listops_transition"][f"{label}_d{w}"] for w in LISTOPS_WIDTHS]
        assert by_width == sorted(by_width, reverse=True)
        assert by_width[-1] < paper / 4 and by_width[0] > paper * 4


def test_owt_profile_counts_are_the_papers(counts):
    """NRGPT paper, OpenWebText table: NRGPT_H_FF2W 90M, GPT 124M, GPT_Rec_parallel 85M; the exact
    numbers are the released code's at d 768, 12 heads, vocab 50304 (docs/nrgpt.md §9)."""
    c = counts["nrgpt_owt"]
    assert c == {"nrgpt_ff2w": 90_496_897, "gpt": 124_448_256, "gpt_rec_parallel": 85_190_784}
    for name, paper in (("nrgpt_ff2w", 90e6), ("gpt", 124e6), ("gpt_rec_parallel", 85e6)):
        assert abs(c[name] / paper - 1) < 0.01  # the paper's rounded numbers, within 1%
    for r in profile_runs("nrgpt_owt"):
        assert r.tokens() == 100_000 * 393_216  # 12 × 1024 × 32 per step, 100k steps
        assert {e["tasks"].split(",")[0] for e in r.evals} == {"mmlu", "mmlu_high_school_computer_science"}
        assert all(e["num_fewshot"] == 5 for e in r.evals)


def test_cem_profile_spans_the_papers_sizes_at_chinchilla_budgets(counts):
    """CEM paper: models of about 86M to 162M parameters at compute-optimal (≈ 20 tokens per
    parameter) budgets; tied CEM layers have about half the attention and two-thirds of the MLP
    parameters of the Llama baseline at the same shape."""
    c = counts["cem_ablation"]
    assert abs(min(c.values()) / 86e6 - 1) < 0.02 and abs(max(c.values()) / 162e6 - 1) < 0.01
    assert max(c, key=c.get) == "llama_base"
    for r in profile_runs("cem_ablation"):
        cfg = r.load_config()
        assert r.tokens() / c[r.name] == pytest.approx(20, rel=0.002)
        assert cfg.train.lr_decay_steps == cfg.train.max_steps
        assert cfg.train.warmup_steps == round(0.02 * cfg.train.max_steps)
        if r.name.startswith("cem_"):
            assert c[r.name] < c[f"llama_{r.group}"]
    ratios = parameter_counts(next(r for r in profile_runs("cem_ablation") if r.name == "cem_base")
                              .model_config())["ratios"]
    assert ratios["attn_projections"] == pytest.approx(0.5) and ratios["mlp_projections"] == pytest.approx(2 / 3)
    assert chinchilla_steps(100, 7) == math.ceil(2000 / 7)


def test_for_world_size_keeps_the_global_batch():
    run = next(r for r in profile_runs("nrgpt_owt") if r.name == "gpt")
    eight = run.for_world_size(8)
    assert eight.overrides["train.grad_accum_steps"] == 4 and eight.tokens_per_step() * 8 == run.tokens_per_step()
    assert run.for_world_size(1).tokens() == run.tokens()
    with pytest.raises(ValueError, match="does not divide grad_accum_steps=32"):
        run.for_world_size(3)
    with pytest.raises(ValueError, match="world_size=0"):
        run.for_world_size(0)


def test_pack_balances_runs():
    runs = profile_runs("nrgpt_owt")
    slots = pack(runs, 2)
    assert sorted(r.name for s in slots for r in s) == sorted(r.name for r in runs)
    assert [len(s) for s in slots] == [1, 2]  # the largest (GPT, 124M) alone; the two smaller together
    with pytest.raises(ValueError, match="n_slots"):
        pack(runs, 0)


def _tiny(run: ProfileRun, data_dir, out_dir) -> ProfileRun:
    arch = run.recipe_dict()["model"]["arch"]
    model = {"d_model": 16, "block_size": 32, "vocab_size": None,
             "n_heads": 1 if run.recipe.startswith("configs/paper/listops") else 2}
    if arch in ("llama", "cem", "gpt"):
        model.update(n_layers=2)
    if arch in ("llama", "cem"):
        model.update(d_ff=32)
    if arch in ("nrgpt", "gpt_rec"):
        model.update(n_steps=2)
    overrides = {**run.overrides, **{f"model.{k}": v for k, v in model.items()}, "data.data_dir": str(data_dir),
                 "train.max_steps": 2, "train.lr_decay_steps": 2, "train.warmup_steps": 0, "train.batch_size": 2,
                 "train.grad_accum_steps": 2, "train.eval_interval": 2, "train.eval_iters": 1,
                 "train.ckpt_interval": 2, "train.log_interval": 1, "train.device": "cpu", "train.dtype": "float32",
                 "train.compile": False, "train.out_dir": str(out_dir / run.name)}
    return ProfileRun(run.name, run.recipe, overrides, run.evals, run.default_vocab_size, run.group)


def test_every_recipe_trains_a_few_steps_at_a_tiny_width(tmp_path):
    data = make_data_dir(tmp_path / "tiny", n_words=600)
    seen: dict[str, ProfileRun] = {}
    for e in EXPERIMENTS:
        for r in profile_runs(e):
            seen.setdefault(r.recipe, r)  # one run per recipe (the sweep's widths share it)
    assert len(seen) == 3 + 5 + 3
    for run in seen.values():
        summary = train(_tiny(run, data, tmp_path / "runs").load_config(), progress=False)
        assert summary["steps"] == 2 and math.isfinite(summary["final_val_loss"]), run.recipe
