"""A resume keeps the run's derived values (train: the schedule; model: d_ff, head_dim, ...) unless they
are given, and compares only the given values with the run's (issue 28)."""
from __future__ import annotations

import pytest
import yaml
from helpers import tiny_config, tiny_config_dict

from energyformer.models.registry import config_from_dict
from energyformer.runs.config import RunConfig, TrainConfig, load_config, save_config
from energyformer.train import train
from energyformer.train.preflight import check_resumable, resolve_resumed_model, resolve_resumed_train


@pytest.mark.parametrize("explicit", [frozenset({"max_steps"}), None], ids=["from a recipe", "built in Python"])
def test_a_resume_keeps_the_runs_derived_train_values_unless_given(explicit):
    saved = TrainConfig(max_steps=1000, lr_schedule="wsd", learning_rate=3e-3, eval_interval=50)
    new = TrainConfig(max_steps=2000, lr_schedule="wsd", learning_rate=3e-3, eval_interval=50)
    kept, words = resolve_resumed_train(saved, new, explicit)
    assert (kept.max_steps, kept.lr_decay_steps, kept.cooldown_steps, kept.min_lr) == (2000, 1000, 100, 3e-3 / 10)
    # what was given is compared and said; the derived values are kept, not reported as changed
    assert "train.max_steps 1000 → 2000" in words
    assert "kept the run's train.lr_decay_steps=1000, train.cooldown_steps=100" in words
    assert "train.lr_decay_steps 1000 →" not in words and "train.cooldown_steps 100 →" not in words
    # given: by name (explicit), or (built in Python) by a value other than its rule's
    given = TrainConfig(max_steps=2000, lr_schedule="wsd", learning_rate=3e-3, eval_interval=50,
                        lr_decay_steps=1800)
    kept, words = resolve_resumed_train(saved, given, None if explicit is None else explicit | {"lr_decay_steps"})
    assert (kept.lr_decay_steps, kept.cooldown_steps) == (1800, 100)
    assert "train.lr_decay_steps 1000 → 1800" in words and "kept the run's train.cooldown_steps=100" in words


@pytest.mark.parametrize("explicit", [frozenset({"max_steps", "lr_schedule"}), None],
                         ids=["from a recipe", "built in Python"])
def test_a_resume_on_another_schedule_derives_the_cooldown_again(explicit):
    """wsd → cosine: the run's cooldown (a part of the wsd schedule) is not kept (cosine refuses one);
    cosine → wsd: it derives from the kept lr_decay_steps. The other derived values are kept."""
    wsd = TrainConfig(max_steps=1000, lr_schedule="wsd", learning_rate=3e-3)
    kept, words = resolve_resumed_train(wsd, TrainConfig(max_steps=2000, lr_schedule="cosine", learning_rate=3e-3),
                                        explicit)
    assert (kept.lr_schedule, kept.lr_decay_steps, kept.cooldown_steps, kept.min_lr) == ("cosine", 1000, 0, 3e-3 / 10)
    assert "train.lr_schedule wsd → cosine, train.cooldown_steps 100 → 0" in words
    assert "kept the run's train.lr_decay_steps=1000" in words
    cosine = TrainConfig(max_steps=1000, lr_schedule="cosine", learning_rate=3e-3)
    kept, words = resolve_resumed_train(cosine, TrainConfig(max_steps=2000, lr_schedule="wsd", learning_rate=3e-3),
                                        explicit)
    assert (kept.lr_decay_steps, kept.cooldown_steps) == (1000, 100) and "train.cooldown_steps 0 → 100" in words
    given = TrainConfig(max_steps=2000, lr_schedule="wsd", learning_rate=3e-3, cooldown_steps=300)
    kept, _ = resolve_resumed_train(wsd, given, None if explicit is None else explicit | {"cooldown_steps"})
    assert kept.cooldown_steps == 300  # given: as given


def test_a_resume_keeps_the_runs_schedule_and_sampler_unless_the_command_line_names_them():
    """The recipe names cosine and the fixed sampler, the run was started with --train.lr_schedule wsd and a
    uniform sampler: a resume from the recipe alone stays on wsd with the run's cooldown and sampler."""
    saved = TrainConfig(max_steps=1000, lr_schedule="wsd", learning_rate=3e-3, depth_sampler="uniform",
                        depth_min=1, depth_max=6)
    recipe = frozenset({"max_steps", "lr_schedule", "learning_rate", "depth_sampler"})
    new = TrainConfig(max_steps=2000, lr_schedule="cosine", learning_rate=3e-3)
    kept, words = resolve_resumed_train(saved, new, recipe, chosen=frozenset({"max_steps"}))
    assert (kept.lr_schedule, kept.cooldown_steps, kept.lr_decay_steps) == ("wsd", 100, 1000)
    assert (kept.depth_sampler, kept.depth_min, kept.depth_max) == ("uniform", 1, 6)
    assert "train.lr_schedule=wsd" in words and "train.depth_sampler=uniform" in words
    assert "lr_schedule wsd → cosine" not in words
    kept, words = resolve_resumed_train(saved, new, recipe, chosen=frozenset({"lr_schedule"}))
    assert (kept.lr_schedule, kept.cooldown_steps, kept.depth_sampler) == ("cosine", 0, "uniform")
    assert "train.lr_schedule wsd → cosine" in words


def test_a_resume_that_forgets_the_schedule_flag_stays_on_the_runs_schedule(data_dir, tmp_path, capsys):
    """End to end: train with --train.lr_schedule wsd over a recipe that says cosine, resume with the recipe
    and a longer max_steps only: config.yaml and the first line say wsd, and the LR curve is wsd's."""
    out = tmp_path / "run"
    recipe = tiny_config_dict(data_dir, out, "gpt", max_steps=4, eval_interval=2, lr_schedule="cosine",
                              learning_rate=1e-3, warmup_steps=0)
    train(load_config(recipe, ["--train.lr_schedule", "wsd"], resolve_vocab=True), progress=False)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr_schedule"] == "wsd"
    capsys.readouterr()
    summary = train(load_config(recipe, ["--train.max_steps", "6"], resolve_vocab=True), progress=None)
    assert summary["resumed_from"] == 4 and summary["steps"] == 6
    first = capsys.readouterr().out.splitlines()[0]
    assert "train.lr_schedule=wsd" in first and "lr_schedule wsd →" not in first, first
    saved = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert (saved["lr_schedule"], saved["max_steps"], saved["lr_decay_steps"]) == ("wsd", 6, 4)


def test_a_derived_value_named_by_the_recipe_is_given_even_when_it_equals_its_rule():
    saved = TrainConfig(max_steps=6, lr_decay_steps=4)
    kept, words = resolve_resumed_train(saved, TrainConfig(max_steps=10, lr_decay_steps=10),
                                        frozenset({"max_steps", "lr_decay_steps"}))
    assert kept.lr_decay_steps == 10 and "train.lr_decay_steps 4 → 10" in words


def _saved_run(tmp_path, model: dict) -> None:
    save_config(RunConfig(model=config_from_dict(model)), tmp_path / "config.yaml")


LLAMA = {"arch": "llama", "vocab_size": 65, "block_size": 16, "d_model": 32, "n_layers": 1, "n_heads": 4}


def test_a_resume_compares_only_the_given_model_values(tmp_path):
    """The run has d_ff 100 (given when it started); a recipe that leaves d_ff to its rule (96) resumes it
    with d_ff 100; one that names d_ff (even at the rule's value) or another d_model does not."""
    _saved_run(tmp_path, {**LLAMA, "d_ff": 100})
    new = load_config({"model": LLAMA})
    saved = check_resumable(tmp_path, new, {}, {})
    model, words = resolve_resumed_model(saved.model, new.model)
    assert (model.d_ff, new.model.d_ff) == (100, 96) and words == "kept the run's model.d_ff=100"
    python_built = RunConfig(model=config_from_dict(LLAMA))  # no explicit keys: given = not its rule's value
    assert check_resumable(tmp_path, python_built, {}, {}).model.d_ff == 100
    for model_section in ({**LLAMA, "d_ff": 96}, {**LLAMA, "d_model": 64}):
        with pytest.raises(ValueError, match="different model"):
            check_resumable(tmp_path, load_config({"model": model_section}), {}, {})
    with pytest.raises(ValueError, match=r"'d_ff': \(100, 120\)"):
        check_resumable(tmp_path, RunConfig(model=config_from_dict({**LLAMA, "d_ff": 120})), {}, {})


def test_a_run_saved_with_null_derived_values_resumes(data_dir, tmp_path, capsys):
    """A CEM run whose config.yaml holds null derived values (as before version 0.3) resumes from the same
    recipe; one given d_ff other than its rule resumes from a recipe that leaves it out and keeps it."""
    out = tmp_path / "cem"
    model = {"arch": "cem", "d_model": 16, "n_layers": 1, "n_heads": 2, "n_steps": 2, "d_ff": 40}
    train(tiny_config(data_dir, out, model, max_steps=2, eval_interval=2), progress=False)
    path = out / "config.yaml"
    old = yaml.safe_load(path.read_text())
    old["model"].update(head_dim=None, attn_n_steps=None, mlp_n_steps=None)
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    capsys.readouterr()
    recipe = tiny_config_dict(data_dir, out, {k: v for k, v in model.items() if k != "d_ff"}, max_steps=4,
                              eval_interval=2)
    summary = train(load_config(recipe, resolve_vocab=True), progress=None)
    assert summary["resumed_from"] == 2 and summary["steps"] == 4
    assert "kept the run's model.d_ff=40" in capsys.readouterr().out
    saved = yaml.safe_load(path.read_text())["model"]
    assert (saved["d_ff"], saved["head_dim"], saved["attn_n_steps"], saved["mlp_n_steps"]) == (40, 8, 2, 2)
