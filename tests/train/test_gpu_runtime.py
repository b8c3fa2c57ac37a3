"""The runtime side of training and inference on NVIDIA GPUs, tested on the CPU (docs/gpu.md):
dtype and backend defaults, the peak FLOP/s table, the device of a torchrun rank, per-rank seeds,
no host read per step or per token, FSDP2's mixed precision and one all-reduce for the replicated
scalars, ``device: auto`` defaults (CUDA RNG states with fewer devices: tests/runs/test_checkpoint.py)."""
import inspect
import math

import pytest
import torch
import torch.distributed as tdist

from energyformer import commands
from energyformer.models.base import CausalLM
from energyformer.models.registry import build_model
from energyformer.runs.checkpoint import find_checkpoint
from energyformer.runs.config import TrainConfig
from energyformer.runs.rundir import read_metrics
from energyformer.train import TrainingDivergedError, train
from energyformer.train import distributed as dist
from energyformer.train import loop as loop_mod
from energyformer.train.metrics import peak_flops, peak_flops_for_name
from energyformer.train.parallelize import mixed_precision_policy
from energyformer.utils import device as device_mod

# ---------------------------------------------------------------- dtype, backends, peak table

def test_dtype_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert TrainConfig().dtype == "auto" and TrainConfig().deterministic is False
    assert device_mod.resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert device_mod.resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert device_mod.resolve_dtype("float32", torch.device("cuda")) == "float32"  # explicit values stay
    assert device_mod.resolve_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    with pytest.raises(ValueError, match="dtype='float16' is not valid"):
        device_mod.resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="train.deterministic='yes' must be true or false"):
        TrainConfig(deterministic="yes")
    amp = device_mod.autocast_context(torch.device("cpu"), "bfloat16")
    assert isinstance(amp, torch.autocast) and amp.fast_dtype == torch.bfloat16
    assert not isinstance(device_mod.autocast_context(torch.device("cpu"), "float32"), torch.autocast)


def test_configure_backends_turns_tf32_and_determinism_on(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        device_mod.configure_backends(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"  # the CPU: unchanged
        device_mod.configure_backends(torch.device("cuda", 0), deterministic=True)
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        import os
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == device_mod.CUBLAS_WORKSPACE
        device_mod.configure_backends(torch.device("cpu"))  # None: leaves determinism as it is
        assert torch.are_deterministic_algorithms_enabled()
        device_mod.configure_backends(torch.device("cpu"), deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA GH200 480GB", 989), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA A10", 125), ("NVIDIA A10G", 125), ("NVIDIA L4", 121), ("NVIDIA L40S", 362),
    ("NVIDIA GeForce RTX 4090", 165), ("Tesla T4", None), ("NVIDIA A40-Q", None)])
def test_peak_table_finds_the_gpu_by_name(name, tflops):
    got = peak_flops_for_name(name)
    assert (got is None) if tflops is None else got == pytest.approx(tflops * 1e12)


def test_peak_flops_of_a_device(monkeypatch):
    monkeypatch.delenv("ENERGYFORMER_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0)) == pytest.approx(989e12)  # the data sheet, not measured
    monkeypatch.setenv("ENERGYFORMER_PEAK_FLOPS", "5e14")
    assert peak_flops(torch.device("cpu")) == 5e14
    monkeypatch.setenv("ENERGYFORMER_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="ENERGYFORMER_PEAK_FLOPS='fast' is not valid"):
        peak_flops(torch.device("cuda", 0))


# ---------------------------------------------------------------- multi-GPU launch

def fake_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("count, local_rank, index", [(1, 3, 0), (4, 3, 3), (2, 3, 1)])
def test_local_rank_device_exists_under_per_rank_visible_devices(monkeypatch, count, local_rank, index):
    fake_cuda(monkeypatch, count)
    assert device_mod.local_cuda_device(local_rank) == torch.device("cuda", index)


def test_init_distributed_takes_the_one_visible_device(monkeypatch):
    fake_cuda(monkeypatch, 1)  # SLURM: CUDA_VISIBLE_DEVICES holds this rank's GPU only
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    for k, v in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(k, v)
    info = dist.init_distributed("auto")
    assert info.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)] and info.rank == 3
    fake_cuda(monkeypatch, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK=3 asks for a CUDA device but none is visible"):
        dist.init_distributed("cuda")


def test_every_rank_draws_its_own_dropout_masks():
    draws = []
    for rank in (0, 1):
        torch.manual_seed(1337)  # what every rank did before building the model
        loop_mod.seed_ranks(1337, dist.DistInfo(rank=rank, world_size=2))
        draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1])
    torch.manual_seed(1337)
    expected = torch.rand(8)
    torch.manual_seed(1337)
    loop_mod.seed_ranks(1337, dist.DistInfo())  # one process keeps its stream
    assert torch.equal(torch.rand(8), expected)


def test_fsdp2_mixed_precision_policy():
    bf16 = mixed_precision_policy("bfloat16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    fp32 = mixed_precision_policy("float32")
    assert fp32.param_dtype is None and fp32.reduce_dtype is None


def test_fsdp2_shards_every_unit_with_the_runs_policy(monkeypatch):
    import torch.distributed.fsdp as fsdp

    from energyformer.train.parallelize import apply_data_parallel

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = build_model({"arch": "nrgpt", "d_model": 16, "n_heads": 2, "n_steps": 2, "block_size": 8,
                         "vocab_size": 11})
    apply_data_parallel(model, dist.DistInfo(world_size=2, parallel="fsdp"), dtype="bfloat16")
    assert calls and calls[-1][0] is model
    assert all(kw["mp_policy"].param_dtype == torch.bfloat16 and kw["mp_policy"].reduce_dtype == torch.float32
               for _, kw in calls)
    scalars = {p for p in model.parameters() if p.dim() == 0}
    assert model._replicated_params and set(model._replicated_params) <= scalars


def test_replicated_scalars_are_reduced_in_one_all_reduce(monkeypatch):
    calls = []

    def fake_all_reduce(t, op=None):
        calls.append(t.numel())
        t.mul_(2)  # two ranks with the same gradients
    monkeypatch.setattr(tdist, "all_reduce", fake_all_reduce)
    model = torch.nn.Module()
    scalars = [torch.nn.Parameter(torch.tensor(float(i))) for i in range(3)]
    for p in scalars:
        p.grad = p.detach() + 1.0
    model._replicated_params = scalars
    dist.reduce_replicated_grads(model, dist.DistInfo(rank=0, world_size=2))
    assert calls == [3]
    assert [float(p.grad) for p in scalars] == [1.0, 2.0, 3.0]


def test_clip_grad_norm_returns_the_norm_on_the_device_and_clips():
    model = torch.nn.Linear(4, 3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    expected = math.sqrt(4.0 * (12 + 3))
    norm = dist.clip_grad_norm(model, 1.0, dist.DistInfo())
    assert isinstance(norm, torch.Tensor) and float(norm) == pytest.approx(expected)
    assert float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------- host reads

def test_training_reads_the_device_only_at_log_interval(tiny_run_config, tmp_path, monkeypatch):
    reads, checks = [], []
    real_check = loop_mod._Loop.check_finite
    monkeypatch.setattr(loop_mod._Loop, "check_finite", lambda self: reads.append(self.step) or real_check(self))
    real_values = CausalLM._check_values
    monkeypatch.setattr(CausalLM, "_check_values", lambda self, *a: checks.append(1) or real_values(self, *a))
    train(tiny_run_config(tmp_path / "run", eval_interval=10, log_interval=5), progress=False)
    assert reads == [5, 10]
    assert len(checks) <= 1  # the FLOP measurement's forward only; no id check per training forward
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [5, 10]


def test_nan_between_log_lines_is_named_and_never_checkpointed(tiny_run_config, tmp_path, monkeypatch):
    from energyformer.models.gpt import GPT

    calls = [0]
    real = GPT.forward

    def nan_from_step_7(model, idx, targets=None):
        logits, loss = real(model, idx, targets)
        if model.training:
            calls[0] += 1
            if calls[0] >= 8:  # the 1st training forward measures the FLOPs
                loss = loss * float("nan")
        return logits, loss
    monkeypatch.setattr(GPT, "forward", nan_from_step_7)
    out = tmp_path / "run"
    with pytest.raises(TrainingDivergedError, match=r"diverged at step 7: loss is nan.*step 5"):
        train(tiny_run_config(out, max_steps=12, log_interval=5, eval_interval=5), progress=False)
    assert find_checkpoint(out)["step"] == 5
    assert max(r["step"] for r in read_metrics(out)) == 5


def test_generate_checks_ids_once_and_still_refuses_bad_ones(monkeypatch):
    model = build_model({"arch": "gpt", "d_model": 32, "n_layers": 1, "n_heads": 2, "block_size": 16,
                         "vocab_size": 11})
    checks = []
    real_values = CausalLM._check_values
    monkeypatch.setattr(CausalLM, "_check_values", lambda self, *a: checks.append(1) or real_values(self, *a))
    out = model.generate(torch.tensor([[1, 2, 3]]), 6, temperature=0)
    assert out.shape == (1, 9) and checks == [1]
    with pytest.raises(ValueError, match=r"token id 11 is out of range; expected ids in \[0, 11\)"):
        model.generate(torch.tensor([[1, 11]]), 3)
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        model.generate([[4, -1]], 3)
    assert not model._ids_checked
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite logits"):
        model.generate(torch.tensor([[1, 2]]), 4, temperature=1.0, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- device defaults

@pytest.mark.parametrize("fn", [commands.sample, commands.evaluate, commands.inspect_energy])
def test_commands_that_run_a_model_default_to_device_auto(fn):
    assert inspect.signature(fn).parameters["device"].default == "auto"
