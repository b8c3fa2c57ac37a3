"""The tables of registry entries in README.md and docs/*.md are generated from the registries
(energyformer.utils.registry.markdown_tables): a marked block that differs fails here; rewrite them
with ``python -m energyformer.utils.registry --write``."""
import subprocess
import sys
from pathlib import Path

import pytest

from energyformer.layers.cem_options import INTERACTIONS, LowRankInteraction
from energyformer.utils.registry import REGISTRIES, markdown_tables, sync_docs

ROOT = Path(__file__).resolve().parents[2]


def test_every_marked_block_is_the_generated_table():
    stale = sync_docs(ROOT)
    assert not stale, ("generated registry tables are stale: " + ", ".join(stale)
                       + "; run `python -m energyformer.utils.registry --write`")


def test_docs_show_every_registry_and_every_entry():
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for option, reg in REGISTRIES.items():
        if reg.module.startswith("energyformer."):
            assert f"<!-- registry:{option} -->" in text, option
    tables = markdown_tables()
    for option, reg in REGISTRIES.items():
        for name in reg.builtin_names():
            assert f"| `{name}` |" in tables[option]


def test_a_changed_entry_makes_the_check_fail_and_write_fixes_it(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("intro\n<!-- registry:mlp_tie -->\nold hand list\n<!-- /registry:mlp_tie -->\nend\n")
    (tmp_path / "README.md").write_text("no blocks here\n")
    assert sync_docs(tmp_path) == ["docs/page.md: mlp_tie"]
    assert sync_docs(tmp_path, write=True) == ["docs/page.md: mlp_tie"]
    assert sync_docs(tmp_path) == [] and "| `gate` |" in page.read_text() and page.read_text().endswith("end\n")
    page.write_text("<!-- registry:nope -->\n<!-- /registry:nope -->\n")
    with pytest.raises(ValueError, match="registry:nope"):
        sync_docs(tmp_path)


def test_plugin_entries_are_not_in_the_docs_tables():
    class Toy(LowRankInteraction):
        """A toy."""

    Toy.__module__ = "someone_elses_plugin"
    INTERACTIONS.register("toy_not_documented")(Toy)
    try:
        assert "toy_not_documented" in INTERACTIONS
        assert "toy_not_documented" not in markdown_tables()["interaction"]
    finally:
        INTERACTIONS.unregister("toy_not_documented")


def test_the_module_prints_the_tables():
    r = subprocess.run([sys.executable, "-m", "energyformer.utils.registry"], cwd=ROOT, capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "<!-- registry:interaction -->" in r.stdout and "| `lowrank` |" in r.stdout


def test_the_registry_module_docstring_example_runs():
    """utils/registry.py's example names classes that exist: it registers an entry as written."""
    import textwrap

    import energyformer.utils.registry as registry_module

    after = registry_module.__doc__.split("::\n", 1)[1].splitlines()[1:]
    code = next(i for i, line in enumerate(after + ["end"]) if line and not line.startswith(" "))
    example = textwrap.dedent("\n".join(after[:code]))  # the indented block after the "::"
    assert "@INTERACTIONS.register" in example
    try:
        exec(compile(example, "energyformer/utils/registry.py docstring", "exec"), {})
        assert "my_interaction" in INTERACTIONS
        assert issubclass(INTERACTIONS.get("my_interaction"), LowRankInteraction)
    finally:
        INTERACTIONS.unregister("my_interaction")
