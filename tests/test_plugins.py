"""Adding a parameterization is one registered class: a toy CEM interaction and a toy NRGPT step map,
each defined in a few lines below, train end to end through the CLI with no other change.

The two snippets are the examples of docs/architecture.md ("Adding an option").
"""
import pytest
import torch
import torch.nn as nn
import yaml
from helpers import make_data_dir

from energyformer.cli import main
from energyformer.layers.cem_options import INTERACTIONS, DiagSharedInteraction
from energyformer.layers.step_maps import STEP_MAPS, StepMap


# --- snippet 1: a CEM interaction (docs/architecture.md) ------------------------------------------
class WarmDiagInteraction(DiagSharedInteraction):
    """D+LR with a shared diagonal that starts at 0.1 instead of 0 (a toy initialisation study)."""

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.full((d_model,), 0.1))


# --- snippet 2: an NRGPT step map (docs/architecture.md) -------------------------------------------
class FixedScalarMap(StepMap):
    """η = s·I with s fixed (a buffer, not learned)."""

    def __init__(self, d_model, scale=None, *, rank=8, norm=None):
        super().__init__(d_model, scale, rank=rank, norm=norm)
        self.register_buffer("s", torch.tensor(self.scale))

    def reset_parameters(self):
        pass

    def forward(self, v):
        return self.s.to(v.dtype) * v

    def matrix(self):
        return self.s * torch.eye(self.d_model, dtype=self.s.dtype, device=self.s.device)


@pytest.fixture
def toy_entries():
    INTERACTIONS.register("warm_diag")(WarmDiagInteraction)
    STEP_MAPS.register("fixed_scalar")(FixedScalarMap)
    yield
    INTERACTIONS.unregister("warm_diag")
    STEP_MAPS.unregister("fixed_scalar")


def _recipe(tmp_path, model):
    data = make_data_dir(tmp_path / "data" / "toy")
    recipe = {"model": {"block_size": 16, "d_model": 16, "n_heads": 2, **model},
              "data": {"data_dir": str(data)},
              "train": {"max_steps": 4, "batch_size": 4, "eval_interval": 2, "eval_iters": 1, "warmup_steps": 1,
                        "log_interval": 1, "device": "cpu"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("model,check", [
    ({"arch": "cem", "n_layers": 1, "d_ff": 24, "interaction": "warm_diag", "rope": "exact"},
     lambda sd: [k for k in sd if k.endswith("attn.interaction.diag")]),
    ({"arch": "nrgpt", "n_steps": 2, "eta_param": "fixed_scalar", "c_init": 0.2},
     lambda sd: [k for k in sd if k == "block.eta.s"]),
])
def test_toy_entries_train_through_the_cli(tmp_path, toy_entries, model, check, capsys):
    out = tmp_path / "run"
    rc = main(["train", str(_recipe(tmp_path, model)), "--train.out_dir", str(out)])
    assert rc == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert check(weights), sorted(weights)
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert saved.get("interaction", saved.get("eta_param")) in ("warm_diag", "fixed_scalar")


def test_unregistered_name_is_a_one_line_cli_error(tmp_path, capsys):
    rc = main(["train", str(_recipe(tmp_path, {"arch": "cem", "interaction": "warm_diag"}))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "interaction='warm_diag'" in err and "lowrank" in err
