"""Exports that carry their code (energyformer.hf.remote_code; docs/hf.md): an energyformer-format
folder loads with ``trust_remote_code=True`` in a Python where importing energyformer fails, and
gives our logits and our greedy generation. Offline (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from run_helpers import make_run  # noqa: E402

from energyformer.hf.export import export_run  # noqa: E402
from energyformer.hf.remote_code import flat_name, remote_sources, rewrite_module  # noqa: E402
from energyformer.runs.rundir import load_run  # noqa: E402

TEXT = "the cat sat on a mat."
#: first lines of every script run without energyformer: importing it fails
BLOCK = "import sys\nsys.modules['energyformer'] = None  # `import energyformer` raises ImportError\n"

_LOAD_SCRIPT = BLOCK + textwrap.dedent("""
    import json, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    text, results = sys.argv[1], {}
    for folder in sys.argv[2:]:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            logits = model(ids["input_ids"]).logits[0]
            greedy = model.generate(**ids, max_new_tokens=40, do_sample=False)  # past block_size 32
            steps = (model.generate(**ids, max_new_tokens=4, do_sample=False, n_steps=3, stop_tol=1e-9)
                     if folder.endswith("nrgpt") else greedy)
            # the adaptive exit runs in the exported code: NRGPT's recurrent block, CEM's in-layer
            # recursion (energy-safe steps with it)
            exited = model.generate(**ids, max_new_tokens=6, do_sample=False, n_steps=8, exit="rel:0.05",
                                    accept_lower_energy=True)
            used = model.model.generated_exit_steps[0].tolist()
        results[folder] = {"cls": type(model).__module__ + "." + type(model).__name__,
                           "ids": ids["input_ids"][0].tolist(), "logits": logits.tolist(),
                           "greedy": greedy[0].tolist(), "steps": steps[0].tolist(),
                           "exited": exited[0].tolist(), "exit_steps": used}
    assert not [m for m, v in sys.modules.items() if m.startswith("energyformer") and v is not None]
    print(json.dumps(results))
""")


def run_without_energyformer(script: str, args: list[str], tmp_path, timeout: int = 300) -> str:
    """stdout of ``script`` in a fresh Python, outside the worktree, where importing energyformer fails."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf_home"),
           "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    cases = {"nrgpt": {"arch": "nrgpt"}, "cem": {"arch": "cem", "attn_n_steps": 2, "tie_embeddings": True}}
    runs = {name: make_run(root / name, spec) for name, spec in cases.items()}
    outs = {name: export_run(run, root / f"hf_{name}") for name, run in runs.items()}
    got = json.loads(run_without_energyformer(_LOAD_SCRIPT, [TEXT] + [str(o) for o in outs.values()],
                                              root).strip().splitlines()[-1])
    return {name: (runs[name], outs[name], got[str(outs[name])]) for name in cases}


@pytest.mark.parametrize("name", ["nrgpt", "cem"])
def test_export_loads_and_generates_without_energyformer(loaded, name):
    run, out, got = loaded[name]
    assert got["cls"].split(".")[-2:] == ["modeling_energyformer", f"Energyformer{name.upper()}ForCausalLM"]
    ours = load_run(run)[0]
    x = torch.tensor([got["ids"]])
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(got["logits"]), ours(x)[0][0], atol=1e-5, rtol=0)
        assert got["greedy"] == ours.generate(x, 40, temperature=0)[0].tolist()
        if name == "nrgpt":
            assert got["steps"] == ours.generate(x, 4, temperature=0, n_steps=3, stop_tol=1e-9)[0].tolist()
        # the per-token adaptive exit through the export's generate (docs/inference_compute.md §4)
        mine = ours.generate(x, 6, temperature=0, n_steps=8, exit="rel:0.05", accept_lower_energy=True)
        assert got["exited"] == mine[0].tolist()
        assert got["exit_steps"] == ours.generated_exit_steps[0].tolist()
        allowed = 8 if name == "nrgpt" else 8 * 2 * ours.config.n_layers  # CEM: summed over layers and sub-blocks
        assert torch.tensor(got["exit_steps"]).min() < allowed  # the exit fired somewhere
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_energyformer.Energyformer{name.upper()}ForCausalLM"


def test_copied_code_has_no_energyformer_import_and_names_every_file(tmp_path):
    import ast

    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    files = remote_sources("nrgpt")
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    for name in files:
        assert "energyformer" not in get_imports(tmp_path / name), name
    copied = {os.path.basename(f) for f in get_relative_import_files(tmp_path / "modeling_energyformer.py")}
    assert copied | {"modeling_energyformer.py"} == set(files)  # what the loader copies is everything
    assert "energyformer_energies_nrgpt.py" in files and "energyformer_models_cem.py" not in files
    ast.parse(files["energyformer_models_registry.py"])


def test_rewrite_makes_package_imports_relative_also_lazy_and_module_imports():
    src = textwrap.dedent('''\
        """doc: from energyformer.layers import x stays in a docstring"""
        from energyformer._validate import check_int
        from energyformer.energies import nrgpt as E
        from energyformer.layers.norms import (LayerNorm,
                                               RMSNorm as R)
        import torch


        def f():
            from energyformer.models.config import ModelConfig
            return ModelConfig
        ''')
    out, needed = rewrite_module(src)
    assert "from .energyformer_validate import check_int" in out
    assert "from . import energyformer_energies_nrgpt as E" in out
    assert "from .energyformer_layers_norms import LayerNorm, RMSNorm as R" in out
    assert "    from .energyformer_models_config import ModelConfig" in out
    assert '"""doc: from energyformer.layers import x stays in a docstring"""' in out
    assert set(needed) == {"energyformer._validate", "energyformer.energies.nrgpt", "energyformer.layers.norms",
                           "energyformer.models.config"}
    assert flat_name("energyformer.hf.modeling") == "modeling_energyformer"
    with pytest.raises(ValueError, match="cannot be made relative"):
        rewrite_module("import energyformer.layers\n")
