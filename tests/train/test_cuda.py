"""CUDA checks of every family (issues 17, 30), skipped without a GPU: one train step in bf16
autocast and in fp32 (the same loss within 1%, finite gradients and updates); the SDPA kernel each
family really runs in bf16, read from the profiler's op names (flash or cuDNN for GPT, Llama,
GPT_Rec, CEM low-rank and NRGPT; the math kernel for none); at GPT-2 width (d ≥ 512) the wide-head
energy attentions (NRGPT full J, CEM's diagonal options) run neither the math nor the
memory-efficient kernel (they take the materialized-scores path, docs/gpu.md) and agree with
their SDPA path; a 20-step ``train()`` on CUDA resumed for 10 whose weights load on the CPU and
give the same logits within 1e-4; cached ≡ uncached greedy generation; activation checkpointing
gives the same loss and gradients.

In ``tests/train/`` because it imports the highest import level it checks (``energyformer.train``).
``benchmarks/gpu_check.py`` runs this file on the GPU machine. ``EF_CUDA_TESTS_ON_CPU=1`` runs
every test on the CPU instead (a dry run of the code paths; the fast kernel expected there is
PyTorch's CPU flash kernel, and the CPU keeps SDPA at every width).
"""
import copy
import importlib.util
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

DRY_RUN = os.environ.get("EF_CUDA_TESTS_ON_CPU") == "1"
if not DRY_RUN and not torch.cuda.is_available():
    pytest.skip("needs CUDA (EF_CUDA_TESTS_ON_CPU=1 dry-runs these tests on the CPU)", allow_module_level=True)

from helpers import make_data_dir  # noqa: E402

from energyformer.models.registry import build_model  # noqa: E402
from energyformer.runs import load_config, load_run  # noqa: E402
from energyformer.runs.rundir import read_metrics  # noqa: E402
from energyformer.train import train  # noqa: E402
from energyformer.train.parallelize import apply_activation_checkpointing  # noqa: E402

DEVICE = "cpu" if DRY_RUN else "cuda"
#: the kernels that count as fast: flash or cuDNN on CUDA; the CPU flash kernel in a dry run
FAST_KERNELS = {"flash_cpu"} if DRY_RUN else {"flash", "cudnn"}
V, N, D, H = 128, 64, 128, 4  # head_dim 32 (NRGPT full J: d_model = 128), inside flash's limits

FAMILIES = {
    "gpt": dict(arch="gpt", n_layers=2),
    "llama": dict(arch="llama", n_layers=2),
    "gpt_rec": dict(arch="gpt_rec", n_steps=3),
    "gpt_rec-parallel": dict(arch="gpt_rec", n_steps=3, parallel=True),
    "cem-lowrank": dict(arch="cem", n_layers=2),
    "cem-lowrank-T2": dict(arch="cem", n_layers=2, n_steps=2),
    "cem-diag_shared": dict(arch="cem", n_layers=2, interaction="diag_shared"),
    "cem-diag_per_head": dict(arch="cem", n_layers=2, interaction="diag_per_head"),
    "cem-full": dict(arch="cem", n_layers=2, n_steps=2, interaction="diag_shared", preconditioner="diag_lowrank",
                     preconditioner_rank=4),
    "nrgpt": dict(arch="nrgpt", n_steps=3),
    "nrgpt-factored": dict(arch="nrgpt", n_steps=3, attention="factored"),
}
#: the families whose bf16 attention must run a flash or cuDNN kernel (the issue's list); every
#: family must avoid the math kernel
FAST_FAMILIES = {"gpt", "llama", "gpt_rec", "gpt_rec-parallel", "cem-lowrank", "cem-lowrank-T2", "nrgpt",
                 "nrgpt-factored"}
CHECKPOINTED = ["gpt", "llama", "gpt_rec", "cem-lowrank-T2", "cem-full", "nrgpt", "nrgpt-factored"]


def _bench_common():
    """benchmarks/common.py (a folder of scripts, not a package), for its SDPA kernel reader."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("_bench_common", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@contextmanager
def full_fp32():
    """fp32 matmuls without TF32 (``train()`` turns TF32 on for the process)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]
        torch.set_float32_matmul_precision(old[2])


def _model(name, perturb=False, **kw):
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "block_size": N, "d_model": D, "n_heads": H, **FAMILIES[name], **kw})
    if perturb:  # off the init (zero diagonals, identity maps), so that nothing is trivially equal
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(DEVICE)


def _ids(b=4, n=N, seed=2):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _autocast(bf16):
    return torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=bf16)


def _loss_and_grads(model, idx, bf16=False):
    model.zero_grad(set_to_none=True)
    with _autocast(bf16):
        _, loss = model(idx, idx)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def test_every_family_is_listed():
    from energyformer.models.registry import LANGUAGE_MODELS

    assert {cfg["arch"] for cfg in FAMILIES.values()} == set(LANGUAGE_MODELS)
    assert FAST_FAMILIES <= FAMILIES.keys() and set(CHECKPOINTED) <= FAMILIES.keys()


@pytest.mark.parametrize("name", FAMILIES)
def test_one_train_step_in_bf16_and_fp32(name):
    """One AdamW step from the same weights: losses within 1%, every gradient and update finite,
    the master weights stay fp32 under autocast."""
    base, idx = _model(name), _ids()
    losses = {}
    for bf16 in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with full_fp32():
            loss, grads = _loss_and_grads(model, idx, bf16)
        assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
        bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        assert not bad, f"{name} bf16={bf16}: non-finite gradients in {bad}"
        opt.step()
        assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in model.parameters())
        losses[bf16] = loss.item()
    assert math.isfinite(losses[False]) and losses[False] > 0
    assert abs(losses[True] - losses[False]) <= 0.01 * losses[False], losses


@pytest.mark.parametrize("name", FAMILIES)
def test_sdpa_kernel_in_bf16(name):
    """The kernels read from the profiler's op names of a bf16 forward + backward: never the math
    kernel; flash or cuDNN (and nothing else) for the families in FAST_FAMILIES."""
    model, idx = _model(name), _ids()
    _loss_and_grads(model, idx, bf16=True)  # warm-up (kernel selection, caches)
    kernels = _bench_common().sdpa_kernels(lambda: _loss_and_grads(model, idx, bf16=True))
    assert "math" not in kernels, f"{name} runs the math SDPA kernel: {kernels}"
    if name in FAST_FAMILIES:
        assert kernels and set(kernels) <= FAST_KERNELS, f"{name}: {kernels}, expected only {sorted(FAST_KERNELS)}"


#: the wide-head families at d 512 (8 heads of 64): NRGPT full J's keys are 512 wide, CEM's
#: augmented heads 64 + 512 = 576 and diag_only's 512, all above the fused kernels' 256
WIDE = {
    "nrgpt-full": dict(arch="nrgpt", n_steps=2),
    "cem-diag_shared": dict(arch="cem", n_layers=1, interaction="diag_shared"),
    "cem-diag_per_head": dict(arch="cem", n_layers=1, interaction="diag_per_head"),
    "cem-diag_only": dict(arch="cem", n_layers=1, interaction="diag_only", rope=None),
}
WIDE_D = 512


def _wide_model(name):
    torch.manual_seed(0)
    return build_model({"vocab_size": V, "block_size": N, "d_model": WIDE_D, "n_heads": 8, **WIDE[name]}).to(DEVICE)


@pytest.mark.parametrize("name", WIDE)
def test_wide_heads_run_no_slow_sdpa_kernel_at_d512(name):
    """At d 512 a bf16 step runs neither the math nor the memory-efficient SDPA kernel: on CUDA the
    wide heads take the materialized-scores path (no SDPA call, or fast ones); in the CPU dry run
    the CPU flash kernel."""
    from energyformer.energies.heads import FUSED_HEAD_DIM_MAX

    model, idx = _wide_model(name), _ids(b=2)
    _loss_and_grads(model, idx, bf16=True)
    kernels = _bench_common().sdpa_kernels(lambda: _loss_and_grads(model, idx, bf16=True))
    assert not {"math", "efficient"} & set(kernels), f"{name} at d {WIDE_D}: {kernels}"
    assert set(kernels) <= FAST_KERNELS, kernels
    assert WIDE_D > FUSED_HEAD_DIM_MAX


@pytest.mark.parametrize("name", WIDE)
def test_wide_heads_default_path_equals_sdpa_path_at_d512(name):
    """The default path (materialized scores on CUDA) against the forced SDPA path, one bf16
    forward + backward at d 512: losses within 1%, gradients within 5% of their norm."""
    from energyformer.energies.heads import force_attention_path

    model, idx = _wide_model(name), _ids(b=2)
    loss, grads = _loss_and_grads(model, idx, bf16=True)
    with force_attention_path("sdpa"):
        loss_sdpa, grads_sdpa = _loss_and_grads(model, idx, bf16=True)
    assert abs(loss.item() - loss_sdpa.item()) <= 0.01 * abs(loss_sdpa.item())
    for n, g in grads.items():
        diff = (g.float() - grads_sdpa[n].float()).norm()
        assert diff <= 0.05 * grads_sdpa[n].float().norm() + 1e-6, f"{name}: {n} differs by {diff:.3g}"


def _run_cfg(data_dir, out, arch_cfg, max_steps):
    train_cfg = dict(out_dir=str(out), max_steps=max_steps, lr_decay_steps=30, batch_size=8, eval_interval=10,
                     eval_iters=2, log_interval=5, warmup_steps=3, learning_rate=3e-3, device=DEVICE,
                     compile=False)
    model_cfg = dict(d_model=64, n_heads=4, block_size=32, **arch_cfg)
    return load_config({"model": model_cfg, "data": {"data_dir": str(data_dir)}, "train": train_cfg},
                       resolve_vocab=True)


@pytest.mark.parametrize("name", ["gpt", "cem-lowrank", "nrgpt"])
def test_train_on_cuda_resume_and_load_on_cpu(name, tmp_path):
    """20 steps of ``train()`` on the device, resumed for 10 more; the run's weights are fp32 and
    give the same logits on the CPU as on the device (fp32, no TF32) within 1e-4."""
    data_dir = make_data_dir(tmp_path / "data")
    out = tmp_path / "run"
    first = train(_run_cfg(data_dir, out, FAMILIES[name], 20), progress=False)
    assert first["steps"] == 20 and first["resumed_from"] is None
    second = train(_run_cfg(data_dir, out, FAMILIES[name], 30), progress=False)
    assert second["resumed_from"] == 20 and second["steps_this_run"] == 10 and second["steps"] == 30
    recs = read_metrics(out)
    assert [r["step"] for r in recs if "train_loss" in r][-1] == 30
    assert all(math.isfinite(r["train_loss"]) for r in recs if "train_loss" in r)
    assert math.isfinite(second["final_val_loss"])
    cpu_model, _, _ = load_run(out, "cpu")
    dev_model, _, _ = load_run(out, DEVICE)
    assert all(p.dtype == torch.float32 for p in cpu_model.state_dict().values() if p.is_floating_point())
    idx = torch.randint(0, cpu_model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), full_fp32():
        on_cpu = cpu_model(idx)[0]
        on_dev = dev_model(idx.to(DEVICE))[0].cpu()
    torch.testing.assert_close(on_dev, on_cpu, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_greedy_generation_equals_uncached(name):
    model = _model(name, perturb=True).eval()
    prompt = _ids(b=2, n=8, seed=4)
    with full_fp32():
        cached = model.generate(prompt, 24, temperature=0.0, use_cache=True)
        uncached = model.generate(prompt, 24, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 32)
    assert torch.equal(cached, uncached), f"{name}: cached {cached.tolist()} != uncached {uncached.tolist()}"


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_activation_checkpointing_same_loss_and_gradients(name):
    model, idx = _model(name), _ids()
    with full_fp32():
        loss, grads = _loss_and_grads(model, idx)
        loss_ck, grads_ck = _loss_and_grads(apply_activation_checkpointing(model), idx)
    torch.testing.assert_close(loss_ck, loss, atol=1e-6, rtol=1e-6)
    assert grads_ck.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(grads_ck[n], grads[n], atol=1e-5, rtol=1e-4, msg=n)
