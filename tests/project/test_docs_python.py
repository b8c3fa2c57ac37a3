"""docs/python.md is code a user pastes: every ```python block runs, in order, in one namespace,
and the front door (``from energyformer import ...``) holds every name it promises."""
from pathlib import Path

import pytest
from helpers import fenced_blocks, make_data_dir

import energyformer

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = fenced_blocks((ROOT / "docs" / "python.md").read_text(encoding="utf-8"))


def test_the_page_has_python_blocks():
    assert len(BLOCKS) >= 5
    assert "from energyformer import" in BLOCKS[0]


def run_blocks(blocks: list[str], page: str) -> dict:
    """Execute ``blocks`` in order in one namespace (returned); a failure names its block."""
    namespace = {"__name__": "docs_python"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page} block {i}", "exec"), namespace)
        except Exception as e:  # name the block that failed
            pytest.fail(f"{page} python block {i} raised {type(e).__name__}: {e}\n{block}")
    return namespace


def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_data_dir(tmp_path / "data" / "tiny")  # the dataset the training block names
    run_blocks(BLOCKS, "docs/python.md")
    assert (tmp_path / "out" / "tiny_nrgpt" / "summary.json").is_file()


@pytest.mark.parametrize("name", sorted(energyformer._EXPORTS))
def test_every_front_door_name_is_the_object_of_its_one_home(name):
    import importlib

    home = energyformer._EXPORTS[name]
    assert getattr(energyformer, name) is getattr(importlib.import_module(home), name)
    assert name in energyformer.__all__ and name in dir(energyformer)


def test_no_front_door_name_hides_a_subpackage():
    import pkgutil

    subpackages = {m.name for m in pkgutil.iter_modules(energyformer.__path__)}
    assert "train" in subpackages and not subpackages & set(energyformer.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'CEMAtention'"):
        energyformer.CEMAtention  # noqa: B018


@pytest.mark.parametrize("name", ["DataConfig", "RunConfig", "TrainConfig", "load_config", "save_config", "load_run"])
def test_run_configs_have_one_home(name):
    import energyformer.runs as runs
    import energyformer.train as train_pkg

    assert hasattr(runs, name) and not hasattr(train_pkg, name)  # the 0.2 alias was removed in 0.3.0


def test_build_model_has_one_entry_point():
    import energyformer.models as models
    from energyformer.models.registry import build_model

    assert not hasattr(models, "build_model") and build_model is not None  # the 0.2 alias was removed in 0.3.0
    model = energyformer.build_model({"arch": "gpt", "vocab_size": 11, "block_size": 8, "d_model": 8, "n_heads": 2})
    assert type(model).__name__ == "GPT"


@pytest.mark.parametrize("kw,pattern", [
    (dict(d_model=0), "d_model=0 must be >= 1"),
    (dict(d_model=64, n_heads=0), "n_heads=0 must be >= 1"),
    (dict(d_model=64, n_heads=3), "n_heads=3 must divide d_model=64"),
    (dict(d_model=64, n_heads=3, head_dim=0), "head_dim=0 must be >= 1"),
    (dict(d_model=64.0, n_heads=4), "d_model=64.0 must be an integer"),
])
def test_one_width_check(kw, pattern):
    from energyformer._validate import check_width

    with pytest.raises(ValueError, match=pattern):
        check_width(**kw)


@pytest.mark.parametrize("arch", ["gpt", "gpt_rec", "llama", "cem", "nrgpt"])
def test_every_config_checks_its_width_with_it(arch):
    from energyformer.layers.baseline import CausalSelfAttention

    with pytest.raises(ValueError, match="n_heads=3 must divide d_model=64"):
        energyformer.build_model({"arch": arch, "vocab_size": 11, "d_model": 64, "n_heads": 3})
    with pytest.raises(ValueError, match="d_model=0 must be >= 1"):
        energyformer.build_model({"arch": arch, "vocab_size": 11, "d_model": 0})
    with pytest.raises(ValueError, match="n_heads=3 must divide d_model=64"):
        CausalSelfAttention(64, 3)
    from energyformer._validate import check_width

    assert check_width(64, 4) == 16 and check_width(64, 3, head_dim=8) == 8 and check_width(64) is None




README_BLOCKS = fenced_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_python_example_uses_the_front_door():
    assert README_BLOCKS and "from energyformer import" in README_BLOCKS[0]


def test_every_readme_python_block_runs_in_order(tmp_path, monkeypatch):
    """The README's example is code a user pastes into their own model: it runs as written."""
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(README_BLOCKS, "README.md")
    assert namespace["logits"].shape == (2, 16, 100) and namespace["out"].shape == (1, 36)


def test_the_models_page_python_block_runs(tmp_path, monkeypatch):
    """docs/models.md's generation example runs as written."""
    monkeypatch.chdir(tmp_path)
    blocks = fenced_blocks((ROOT / "docs" / "models.md").read_text(encoding="utf-8"))
    assert blocks
    namespace = run_blocks(blocks, "docs/models.md")
    assert namespace["out"].shape == (1, 52) and isinstance(namespace["rows"], list)
