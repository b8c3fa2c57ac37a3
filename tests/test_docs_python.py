"""docs/python.md is code a user pastes: every ```python block runs, in order, in one namespace,
and the front door (``from energyformer import ...``) holds every name it promises."""
from pathlib import Path

import pytest
from helpers import fenced_blocks, make_data_dir

import energyformer

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = fenced_blocks((ROOT / "docs" / "python.md").read_text(encoding="utf-8"))


def test_the_page_has_python_blocks():
    assert len(BLOCKS) >= 5
    assert "from energyformer import" in BLOCKS[0]


def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_data_dir(tmp_path / "data" / "tiny")  # the dataset the training block names
    namespace = {"__name__": "docs_python"}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"docs/python.md block {i}", "exec"), namespace)
        except Exception as e:  # name the block that failed
            pytest.fail(f"docs/python.md block {i} raised {type(e).__name__}: {e}\n{block}")
    assert (tmp_path / "out" / "tiny_nrgpt" / "summary.json").is_file()


@pytest.mark.parametrize("name", sorted(energyformer._EXPORTS))
def test_every_front_door_name_is_the_object_of_its_one_home(name):
    import importlib

    home = energyformer._EXPORTS[name]
    assert getattr(energyformer, name) is getattr(importlib.import_module(home), name)
    assert name in energyformer.__all__ and name in dir(energyformer)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'CEMAtention'"):
        energyformer.CEMAtention  # noqa: B018
