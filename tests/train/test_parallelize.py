"""train/parallelize.py: checkpointing, DDP/FSDP and compile applied in one place, without
changing weight names or what the models compute (the numerics are in test_checkpointing.py,
test_distributed.py and test_compile.py)."""
import pytest
import torch

from energyformer import build_model
from energyformer.models.registry import LANGUAGE_MODELS
from energyformer.train.distributed import DistInfo
from energyformer.train.parallelize import apply_activation_checkpointing, parallelize, shard_units

V, N = 32, 16


def _model(arch):
    torch.manual_seed(0)
    return build_model(dict(arch=arch, vocab_size=V, block_size=N, d_model=32, n_heads=4))


@pytest.mark.parametrize("arch", LANGUAGE_MODELS)
def test_checkpointing_keeps_weight_names_and_can_be_undone(arch):
    model = _model(arch)
    names = list(model.state_dict())
    apply_activation_checkpointing(model)
    assert list(model.state_dict()) == names  # no wrapper module, no prefix
    units = [u for u, _ in shard_units(model)]
    assert units
    for unit in units:
        steppers = [m for m in unit.modules() if hasattr(type(m), "checkpoint_steps")]
        assert all(m.checkpoint_steps for m in steppers) and (steppers or "forward" in vars(unit))
    apply_activation_checkpointing(model, enabled=False)
    for unit in units:
        assert "forward" not in vars(unit)
        assert not any(getattr(m, "checkpoint_steps", False) for m in unit.modules())


@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt_rec", "nrgpt"])
def test_a_checkpointed_model_still_decodes_with_a_cache(arch):
    model = _model(arch)
    idx = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(0))
    want = model.generate(idx, 5, temperature=0)
    apply_activation_checkpointing(model.train())
    torch.testing.assert_close(model.generate(idx, 5, temperature=0), want)


def test_one_process_without_compile_trains_the_model_itself():
    model = _model("gpt")
    wrapped, fwd = parallelize(model, DistInfo(), activation_checkpointing=True)
    assert wrapped is model and fwd is model
    assert "forward" in vars(model.blocks[0])
