"""Run directories written by version 0.1 (weight names before the option registries) still load."""
import re

import pytest
import torch
from safetensors.torch import save_file

from energyformer.models.registry import build_model
from energyformer.runs.weights import load_weights

V = 11
# today's name -> the 0.1 name (the inverse of each model's legacy_renames)
TO_OLD = {
    "cem": [(r"\.attn\.interaction\.", ".attn."), (r"\.preconditioner\.", ".precond.")],
    "nrgpt": [(r"^block\.attention\.", "block."), (r"^block\.ff\.", "block."),
              (r"^block\.eta\.weight$", "block.eta_proj.weight"),
              (r"^block\.eta\.c_raw$", "block.c_raw"), (r"^block\.eta\.([LS])$", r"block.eta_\1")],
}


@pytest.mark.parametrize("cfg", [
    dict(arch="cem", interaction="diag_per_head", preconditioner="diag_lowrank", preconditioner_rank=2, n_steps=2),
    dict(arch="nrgpt", attention="full", eta_param="full"),
    dict(arch="nrgpt", attention="factored", ff="ff2", eta_param="c_diag_gamma"),
    dict(arch="nrgpt", eta_param="psd_plus_skew", norm="none"),
])
def test_version_0_1_weight_names_load(tmp_path, cfg):
    cfg = dict(vocab_size=V, block_size=8, d_model=8, n_heads=2, **cfg)
    torch.manual_seed(0)
    src = build_model(cfg)
    old = {}
    for name, t in src.state_dict().items():
        for pat, rep in TO_OLD[cfg["arch"]]:
            name = re.sub(pat, rep, name)
        old[name] = t.contiguous()
    assert set(old) != set(src.state_dict())  # the file really uses the old names
    save_file(old, str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    dst = build_model(cfg)
    load_weights(dst, tmp_path / "model.safetensors")
    idx = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(dst(idx)[0], src(idx)[0], atol=0, rtol=0)
