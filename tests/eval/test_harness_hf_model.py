"""`python -m energyformer.eval.harness --model hf ...` (docs/hf.md: lm-eval's own hf model on an
exported folder) must find lm-eval's own models, not only ``energyformer``."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")


def test_harness_command_line_knows_lm_evals_hf_model(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "energyformer.eval.harness", "--model", "hf", "--model_args",
                           f"pretrained={tmp_path / 'missing'}", "--tasks", "arc_easy", "--limit", "1",
                           "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert "Unknown model 'hf'" not in out and "no model for this name found" not in out, out[-2000:]


def test_harness_command_line_registers_the_energyformer_model_types():
    """``--model hf`` on an energyformer-format export needs energyformer_* in transformers' Auto classes."""
    script = ("import sys\nimport lm_eval.__main__ as cli\nfrom energyformer.eval import harness\n"
              "assert 'energyformer.hf' not in sys.modules\n"
              "def check():\n    from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
              "    print('registered' if 'energyformer_nrgpt' in CONFIG_MAPPING else 'missing')\n"
              "cli.cli_evaluate = check\nharness.main([])\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "registered", proc.stderr[-2000:]
