"""Derived defaults (issue 28): each config class declares its derived fields once (``derived``: field ->
rule), one step fills them (:func:`energyformer.utils.derived.fill_derived`), and
:func:`~energyformer.utils.derived.given_values` drops a value equal to what its rule derives, so an
override of an input derives them again. Saved configs hold the concrete values; old ones with ``null``
still load to the same model."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from energyformer.models.config import default_d_ff
from energyformer.models.registry import build_model, config_from_dict, get_arch, given_fields
from energyformer.runs.config import TrainConfig
from energyformer.runs.rundir import load_run, read_run_config
from energyformer.utils import derived

ZOO = Path(__file__).resolve().parents[2] / "energyformer" / "zoo"
FAMILIES = ["gpt", "gpt_rec", "llama", "cem", "nrgpt"]
#: what each family derives at d_model=128, n_heads=4 (head_dim: only the families that have one)
AT_128 = {"gpt": {"d_ff": 512}, "gpt_rec": {"d_ff": 512},
          "llama": {"d_ff": default_d_ff(128), "head_dim": 32, "n_kv_heads": 4},
          "cem": {"d_ff": default_d_ff(128), "head_dim": 32, "attn_n_steps": 2, "mlp_n_steps": 2},
          "nrgpt": {"d_ff": 512, "head_dim": 32}}


def _config(arch: str, d_model: int = 64, **kw):
    extra = {"n_steps": 2} if arch in ("cem", "nrgpt", "gpt_rec") else {}
    return config_from_dict({"arch": arch, "vocab_size": 65, "d_model": d_model, "n_heads": 4, **extra, **kw})


@pytest.mark.parametrize("arch", FAMILIES)
def test_overriding_d_model_derives_d_ff_and_head_dim_again(arch):
    """Every family: ``build_model(cfg, d_model=128)`` and ``derived.replace(cfg, d_model=128)`` give the
    d_ff and head_dim of d_model 128 (not the 64-wide config's): the config a fresh d_model=128 would have."""
    small = _config(arch)
    assert {k: getattr(small, k) for k in AT_128[arch]} != AT_128[arch]  # the override has to change them
    for cfg in (build_model(small, d_model=128).config, derived.replace(small, d_model=128)):
        assert {k: getattr(cfg, k) for k in AT_128[arch]} == AT_128[arch]
        assert cfg == _config(arch, 128)
    # a given value that differs from its rule stays given
    wide = _config(arch, d_ff=100)
    assert build_model(wide, d_model=128).config.d_ff == derived.replace(wide, d_model=128).d_ff == 100


@pytest.mark.parametrize("arch", FAMILIES + ["regressor"])
def test_every_derived_field_is_declared_and_filled(arch):
    """The rules name fields whose default is their sentinel, a built config holds no sentinel in them, and
    ``given_fields`` rebuilds an equal config (the one resolution step is the only one)."""
    _, cls = get_arch(arch)
    rules = derived.derived_rules(cls)
    assert rules, f"{cls.__name__} declares no derived field"
    cfg = cls()
    for name in rules:
        assert getattr(cfg, name) != derived.sentinel(cls, name), name
    assert config_from_dict(given_fields(cfg)) == cfg
    assert not set(rules) & set(given_fields(cfg))  # nothing given: every derived value is the rule's


def test_nrgpt_preset_dependent_fields_follow_the_preset_unless_given():
    ref = config_from_dict({"arch": "nrgpt", "preset": "reference"})
    assert (ref.mask, ref.norm, ref.learn_alpha) == ("inclusive", "layernorm_frozen", False)
    assert set(given_fields(ref)).isdisjoint({"mask", "norm", "learn_alpha", "beta", "c_init"})
    plain = derived.replace(ref, preset=None)
    assert (plain.mask, plain.norm, plain.learn_alpha) == ("strict", "layernorm", True)
    kept = derived.replace(config_from_dict({"arch": "nrgpt", "preset": "reference", "mask": "strict"}),
                           preset=None, attention="factored", head_dim=8)
    assert kept.mask == "strict" and kept.beta == pytest.approx(8 ** -0.5)  # beta from the new head_dim


def test_train_config_derives_its_schedule_in_one_step():
    tc = TrainConfig(max_steps=1000, learning_rate=2e-3, lr_schedule="wsd", eval_interval=50)
    assert (tc.min_lr, tc.lr_decay_steps, tc.cooldown_steps, tc.ckpt_interval) == (2e-4, 1000, 100, 50)
    assert not set(derived.derived_rules(TrainConfig)) & set(derived.given_values(tc))
    longer = derived.replace(tc, max_steps=3000)
    assert (longer.lr_decay_steps, longer.cooldown_steps) == (3000, 300)
    assert dataclasses.replace(tc, max_steps=3000).lr_decay_steps == 1000  # dataclasses.replace keeps them
    with pytest.raises(ValueError, match=r"train.lr_decay_steps=-1"):  # checked before a rule reads it
        TrainConfig(lr_decay_steps=-1, lr_schedule="wsd")


NULL_CONFIGS = {  # configs as versions before 0.3 saved them (derived Llama/CEM fields null)
    "llama": {"arch": "llama", "vocab_size": 65, "block_size": 16, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "head_dim": None, "d_ff": None, "n_kv_heads": None},
    "cem": {"arch": "cem", "vocab_size": 65, "block_size": 16, "d_model": 32, "n_layers": 2, "n_heads": 4,
            "head_dim": None, "d_ff": None, "n_steps": 2, "attn_n_steps": None, "mlp_n_steps": None},
}


@pytest.mark.parametrize("arch", sorted(NULL_CONFIGS))
def test_old_configs_with_null_load_to_the_same_model(arch, tmp_path):
    old = NULL_CONFIGS[arch]
    cfg = config_from_dict(old)
    concrete = cfg.to_dict()
    assert all(concrete[k] is not None for k in old if old[k] is None)  # saved now: concrete values
    assert config_from_dict(concrete) == cfg
    models = []
    for d in (old, concrete):
        torch.manual_seed(0)
        models.append(build_model(dict(d)))
    for (name, p), q in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(p, q), name
    # a run directory's config.yaml written with nulls reads back as the concrete config
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": old, "data": {}, "train": {}}))
    assert read_run_config(tmp_path).model == cfg


#: the derived model fields that runs saved before derived values were concrete hold as ``null``
OLD_NULLS = {"llama_shakespeare_char": ("head_dim", "n_kv_heads"),
             "cem_shakespeare_char": ("head_dim", "attn_n_steps", "mlp_n_steps")}


@pytest.mark.parametrize("name", sorted(OLD_NULLS))
def test_runs_saved_with_null_derived_values_still_load(name, tmp_path):
    """Runs saved before derived values were concrete (``head_dim: null``, as the zoo's first entries
    were): a zoo run rewritten in that form loads, weights and all, into a config holding the
    concrete values."""
    run = tmp_path / name
    shutil.copytree(ZOO / name, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"].update(dict.fromkeys(OLD_NULLS[name]))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    saved = cfg["model"]
    model, run_cfg, _ = load_run(run)
    assert run_cfg.model.head_dim == saved["d_model"] // saved["n_heads"]
    assert model.config == run_cfg.model
