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
