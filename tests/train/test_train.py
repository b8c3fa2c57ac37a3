"""The training loop: loss goes down, metrics/checkpoint files, exact resume, divergence handling,
optimizer parameter groups and the learning-rate schedule."""
import dataclasses
import json
import math

import pytest
import torch
from helpers import make_data_dir, tiny_config

from energyformer.models import ARCHS, get_arch
from energyformer.runs import load_config, load_run
from energyformer.runs.checkpoint import find_checkpoint, load_train_state
from energyformer.runs.config import TrainConfig
from energyformer.runs.rundir import read_metrics
from energyformer.train import TrainingDivergedError, lr_at, train
from energyformer.train import loop as loop_mod
from energyformer.train.optim import build_optimizer, param_groups


def tiny_cfg(data_dir, out_dir, model=None, **train_kw):
    """The shared tiny config (the tiny GPT; ``model`` with an ``arch``: that model), trained 30 steps."""
    return tiny_config(data_dir, out_dir, model or "gpt", **{"max_steps": 30, "batch_size": 8, "eval_interval": 10,
                                                             "eval_iters": 2, "warmup_steps": 3, **train_kw})


def test_training_lowers_loss_and_writes_run_files(data_dir, tmp_path):
    out = tmp_path / "run"
    summary = train(tiny_cfg(data_dir, out), progress=False)
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]

    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 31))
    first, last = recs[0]["train_loss"], recs[-1]["train_loss"]
    assert first == pytest.approx(math.log(vocab), abs=0.3)  # starts near uniform
    assert last < first - 0.7, (first, last)
    assert summary["final_val_loss"] < math.log(vocab) - 0.7
    assert summary["steps"] == 30 and summary["steps_this_run"] == 30 and summary["resumed_from"] is None
    assert summary["best_val_loss"] <= summary["final_val_loss"]
    assert summary["tokens_per_s"] > 0 and summary["params"] > summary["params_non_embedding"] > 0

    for r in recs:
        assert {"step", "train_loss", "lr", "tokens_per_s", "grad_norm"} <= set(r)
        assert ("val_loss" in r) == (r["step"] % 10 == 0)
    assert recs[-1]["val_loss"] == pytest.approx(summary["final_val_loss"])

    names = {p.name for p in out.iterdir()}
    assert {"config.yaml", "meta.json", "model.safetensors", "checkpoint.json", "checkpoints",
            "metrics.jsonl", "summary.json"} <= names
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000030"]
    assert not [n for n in names if n.endswith(".tmp") or n.startswith(".") and n != ".lock"], names  # atomic writes
    assert find_checkpoint(out)["step"] == 30
    assert json.loads((out / "meta.json").read_text()) == json.loads((data_dir / "meta.json").read_text())
    state = load_train_state(out)
    assert state["step"] == 30 and state["best_val_loss"] == pytest.approx(summary["best_val_loss"])
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"] == 30 and saved["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert saved["params"] == summary["params"]


def test_resume_is_exact(data_dir, tmp_path):
    """N steps + resume for N more == 2N steps (dropout on, so the RNG states matter too)."""
    kw = dict(max_steps=12, lr_decay_steps=12, eval_interval=4, ckpt_interval=4, grad_accum_steps=2,
              batch_size=4)
    model = dict(dropout=0.1)
    full = tmp_path / "full"
    train(tiny_cfg(data_dir, full, model, **kw), progress=False)

    part = tmp_path / "part"
    kw_half = dict(kw, max_steps=6)  # stops between two checkpoints: final checkpoint at step 6
    train(tiny_cfg(data_dir, part, model, **kw_half), progress=False)
    assert find_checkpoint(part)["step"] == 6
    summary = train(tiny_cfg(data_dir, part, model, **kw), progress=False)  # resume="auto"
    assert summary["resumed_from"] == 6 and summary["steps_this_run"] == 6

    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], abs=1e-6), ra["step"]
        assert rb["lr"] == pytest.approx(ra["lr"], abs=1e-12)
        if ra["step"] % 4 == 0:
            assert rb["val_loss"] == pytest.approx(ra["val_loss"], abs=1e-6)
    ma, _, _ = load_run(full)
    mb, _, _ = load_run(part)
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)


def test_resume_when_already_done_and_never(data_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(data_dir, out, max_steps=3), progress=False)
    before = (out / "model.safetensors").read_bytes()
    again = train(tiny_cfg(data_dir, out, max_steps=3), progress=False)
    assert again["steps_this_run"] == 0 and again["resumed_from"] == 3
    assert math.isfinite(again["final_val_loss"])
    assert (out / "model.safetensors").read_bytes() == before  # nothing trained, nothing rewritten
    fresh = train(tiny_cfg(data_dir, out, max_steps=2, resume="never"), progress=False)
    assert fresh["resumed_from"] is None and find_checkpoint(out)["step"] == 2
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_resume_from_explicit_path_and_errors(data_dir, tmp_path):
    src = tmp_path / "src"
    train(tiny_cfg(data_dir, src, max_steps=2), progress=False)
    dst = tmp_path / "dst"
    s = train(tiny_cfg(data_dir, dst, max_steps=4, resume=str(src)), progress=False)
    assert s["resumed_from"] == 2 and find_checkpoint(dst)["step"] == 4
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train(tiny_cfg(data_dir, dst, resume=str(tmp_path / "nowhere")), progress=False)
    with pytest.raises(ValueError, match="different model.*d_model"):
        train(tiny_cfg(data_dir, src, model=dict(d_model=16), max_steps=4), progress=False)


def _nan_after(forward, k):
    """Wrap GPT.forward so that the training loss becomes NaN from the k-th training forward on."""
    calls = [0]

    def patched(model, idx, targets=None):
        logits, loss = forward(model, idx, targets)
        if model.training:
            calls[0] += 1
            if calls[0] >= k:
                loss = loss * float("nan")
        return logits, loss

    return patched


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    from energyformer.models.gpt import GPT

    out = tmp_path / "run"
    # the 1st training forward measures the FLOPs per token (models/flops.py); the 8th is step 7's
    monkeypatch.setattr(GPT, "forward", _nan_after(GPT.forward, k=8))
    cfg = tiny_cfg(data_dir, out, max_steps=10, ckpt_interval=4, eval_interval=4)
    with pytest.raises(TrainingDivergedError, match=r"step 7: loss is nan.*step 4"):
        train(cfg, progress=False)
    monkeypatch.undo()
    assert find_checkpoint(out)["step"] == 4
    assert load_train_state(out)["step"] == 4
    model, _, _ = load_run(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max(r["step"] for r in read_metrics(out)) == 6
    summary = train(cfg, progress=False)  # the kept checkpoint resumes cleanly
    assert summary["resumed_from"] == 4 and summary["steps"] == 10


def test_infinite_grad_norm_stops(data_dir, tmp_path, monkeypatch):
    real_build = loop_mod.build_model

    def build_with_bad_grad(cfg):
        model = real_build(cfg)
        model.wte.weight.register_hook(lambda g: g * float("inf"))
        return model

    monkeypatch.setattr(loop_mod, "build_model", build_with_bad_grad)
    with pytest.raises(TrainingDivergedError, match="step 1: gradient norm is (inf|nan).*No checkpoint"):
        train(tiny_cfg(data_dir, tmp_path / "run", max_steps=3), progress=False)
    assert find_checkpoint(tmp_path / "run") is None


def test_huge_learning_rate_diverges_with_clear_error(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, tmp_path / "run", max_steps=30, learning_rate=1e30, warmup_steps=0,
                   grad_clip=0.0, weight_decay=0.0)
    with pytest.raises(TrainingDivergedError, match=r"training diverged at step \d+"):
        train(cfg, progress=False)


def test_vocab_too_small_for_data(data_dir, tmp_path):
    with pytest.raises(ValueError, match="model.vocab_size=3 is smaller than the data vocabulary"):
        train(tiny_cfg(data_dir, tmp_path / "run", model=dict(vocab_size=3)), progress=False)


def test_bf16_tensorboard_and_threads(data_dir, tmp_path):
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        s = train(tiny_cfg(data_dir, out, max_steps=2, dtype="bfloat16", tensorboard=True, num_threads=1),
                  progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(s["final_val_loss"])
    pytest.importorskip("tensorboard")
    assert any((out / "tb").iterdir())


def test_param_groups_decay_only_matrices():
    from energyformer import build_model

    model = build_model(dict(arch="gpt", vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2,
                             tie_embeddings=True))
    model.ln_f.weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids))  # the tied embedding appears once
    assert id(model.ln_f.weight) not in ids
    assert len(ids) == sum(1 for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, TrainConfig(beta1=0.8, beta2=0.95))
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_lr_schedule():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # cosine half way
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    exp = TrainConfig(learning_rate=1.0, min_lr=0.01, warmup_steps=0, max_steps=100, lr_schedule="exponential")
    assert lr_at(50, exp) == pytest.approx(0.1)
    const = TrainConfig(learning_rate=0.5, warmup_steps=2, lr_schedule="constant")
    assert [lr_at(s, const) for s in (0, 2, 1000)] == pytest.approx([0.5 / 3, 0.5, 0.5])


def test_wsd_schedule():
    """warmup-stable-decay: constant until the cooldown, then linear to min_lr at lr_decay_steps."""
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.0, warmup_steps=10, max_steps=100, lr_schedule="wsd")
    assert cfg.cooldown_steps == 10  # default: a tenth of lr_decay_steps
    assert [lr_at(s, cfg) for s in (9, 10, 50, 90)] == pytest.approx([10 / 11, 1.0, 1.0, 1.0])
    assert [lr_at(s, cfg) for s in (95, 100, 200)] == pytest.approx([0.5, 0.0, 0.0])
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    long = TrainConfig(learning_rate=2.0, min_lr=0.2, max_steps=1000, lr_decay_steps=600, lr_schedule="wsd",
                       cooldown_steps=100, warmup_steps=0)
    assert [lr_at(s, long) for s in (500, 550, 600, 900)] == pytest.approx([2.0, 1.1, 0.2, 0.2])
    with pytest.raises(ValueError, match="cooldown_steps=5 needs train.lr_schedule='wsd'"):
        TrainConfig(cooldown_steps=5)
    with pytest.raises(ValueError, match="cooldown_steps"):
        TrainConfig(lr_schedule="wsd", cooldown_steps=-1)


def _tiny_arch(arch):
    kw = dict(arch=arch, d_model=16, n_heads=2)
    names = {f.name for f in dataclasses.fields(get_arch(arch)[1])}
    for key, value in (("n_layers", 2), ("n_steps", 2)):
        if key in names:
            kw[key] = value
    return kw


def _language_models():
    """Archs that read token ids (``forward(idx, ...)``); regression models read vectors."""
    import inspect
    return sorted(a for a in ARCHS if list(inspect.signature(get_arch(a)[0].forward).parameters)[1] == "idx")


@pytest.mark.parametrize("arch", _language_models())
def test_every_arch_trains_and_reloads_exactly(arch, data_dir, tmp_path, monkeypatch):
    """The loop and checkpoints work for every registered model (tied weights, frozen params...)."""
    built = []
    real_build = loop_mod.build_model
    monkeypatch.setattr(loop_mod, "build_model", lambda cfg: built.append(real_build(cfg)) or built[-1])
    s = train(tiny_cfg(data_dir, tmp_path / arch, model=_tiny_arch(arch), max_steps=3, eval_iters=1),
              progress=False)
    assert math.isfinite(s["final_val_loss"])
    loaded, cfg, _ = load_run(tmp_path / arch)
    assert cfg.model.arch == arch
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    built[-1].eval()  # built[0] is the meta-device model of the memory check
    torch.testing.assert_close(loaded(idx)[0], built[-1](idx)[0], atol=0, rtol=0)


def test_modules_can_exempt_matrices_from_weight_decay():
    """CEM's per-head diagonal and preconditioner factors are 2-D but not decayed (train/optim.py)."""
    from energyformer import build_model
    model = build_model({"arch": "cem", "vocab_size": 11, "block_size": 8, "d_model": 16, "n_layers": 1,
                         "n_heads": 2, "d_ff": 32, "interaction": "diag_per_head", "rope": None,
                         "preconditioner": "diag_lowrank", "preconditioner_rank": 2})
    decay, no_decay = (set(map(id, g["params"])) for g in param_groups(model, 0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    exempt = {names[i] for i in no_decay if dict(model.named_parameters())[names[i]].dim() >= 2}
    assert any(".attn." in n and n.endswith(".diag") for n in exempt)  # attn.diag / attn.interaction.diag
    assert any("precond" in n and n.endswith(".u") for n in exempt)
    assert any("precond" in n and n.endswith(".v") for n in exempt)
    assert any(n.endswith("q_proj.weight") for n in (names[i] for i in decay))


def test_auto_resume_refuses_to_delete_an_incomplete_checkpoint(data_dir, tmp_path):
    """resume=auto with checkpoint files but no complete checkpoint must not silently start over."""
    out = tmp_path / "run"
    train(tiny_cfg(data_dir, out, max_steps=4, eval_interval=2), progress=False)
    (out / "checkpoint.json").write_text("{}")
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"no complete checkpoint.*--train.resume never"):
        train(tiny_cfg(data_dir, out, max_steps=6, eval_interval=2), progress=False)
    assert (out / "model.safetensors").read_bytes() == weights  # nothing was deleted
    s = train(tiny_cfg(data_dir, out, max_steps=2, eval_interval=2, resume="never"), progress=False)
    assert s["steps"] == 2 and s["resumed_from"] is None


def test_non_finite_weights_are_never_checkpointed(data_dir, tmp_path, monkeypatch):
    """An optimizer step can blow the weights up while that step's loss was finite."""
    out = tmp_path / "run"
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def step_then_poison(self, *a, **kw):
        result = real_step(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 5:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    cfg = tiny_cfg(data_dir, out, max_steps=10, ckpt_interval=1, eval_interval=100)
    with pytest.raises(TrainingDivergedError, match=r"non-finite at step 5.*step 4"):
        train(cfg, progress=False)
    assert find_checkpoint(out)["step"] == 4
    model, _, _ = load_run(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_keeps_the_runs_schedule_and_says_what_changed(data_dir, tmp_path, capsys):
    """Raising max_steps on resume keeps lr_decay_steps (no LR jump) unless given explicitly."""
    out = tmp_path / "run"
    train(tiny_cfg(data_dir, out, max_steps=6, eval_interval=3), progress=None)
    capsys.readouterr()
    train(tiny_cfg(data_dir, out, max_steps=10, eval_interval=3), progress=None)
    said = capsys.readouterr().out
    assert "train.max_steps 6 → 10" in said and "kept the run's train.lr_decay_steps=6" in said
    lrs = {r["step"]: r["lr"] for r in read_metrics(out)}
    min_lr = 3e-3 / 10
    assert lrs[7] == pytest.approx(min_lr) and lrs[10] == pytest.approx(min_lr)  # no jump back up
    # given explicitly, the new value wins (and is said)
    cfg = load_config({"model": dict(arch="gpt", d_model=32, n_layers=2, n_heads=2, block_size=16),
                       "data": {"data_dir": str(data_dir)},
                       "train": dict(out_dir=str(out), max_steps=12, batch_size=8, eval_interval=3, eval_iters=2,
                                     log_interval=1, warmup_steps=3, learning_rate=3e-3, device="cpu",
                                     lr_decay_steps=12)}, resolve_vocab=True)
    train(cfg, progress=None)
    said = capsys.readouterr().out
    assert "train.lr_decay_steps 6 → 12" in said
    assert read_metrics(out)[-1]["lr"] > min_lr


def test_a_no_op_run_keeps_a_truthful_summary(data_dir, tmp_path):
    out = tmp_path / "run"
    first = train(tiny_cfg(data_dir, out, max_steps=4), progress=False)
    before = (out / "summary.json").read_bytes()
    config = (out / "config.yaml").read_bytes()
    again = train(tiny_cfg(data_dir, out, max_steps=4), progress=False)
    assert (out / "summary.json").read_bytes() == before  # not overwritten with 0 tokens/s
    # a no-op call with other values (here a smaller max_steps and batch) records nothing it never ran
    train(tiny_cfg(data_dir, out, max_steps=3, batch_size=4), progress=False)
    assert (out / "config.yaml").read_bytes() == config
    assert again["steps_this_run"] == 0 and again["tokens_per_s"] == first["tokens_per_s"]
    # a resumed run reports speed and time over all its segments
    resumed = train(tiny_cfg(data_dir, out, max_steps=6), progress=False)
    assert resumed["steps_this_run"] == 2 and resumed["minutes"] > first["minutes"]
    assert resumed["tokens_per_s"] > 0
    # and the CPU time of its processes over all segments, which a pause or a shared core does not inflate
    assert 0 < first["cpu_minutes"] < resumed["cpu_minutes"]


def test_cpu_minutes_are_unknown_after_a_checkpoint_that_predates_them(data_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(data_dir, out, max_steps=2), progress=False)
    ckpt_dir = next(p for p in out.glob("checkpoints/step-*"))
    state_file = ckpt_dir / "train_state.pt"
    state = torch.load(state_file, weights_only=True)
    del state["extra"]["cpu_s"]  # as an older energyformer wrote it
    torch.save(state, state_file)
    resumed = train(tiny_cfg(data_dir, out, max_steps=4), progress=False)
    assert resumed["steps_this_run"] == 2 and resumed["cpu_minutes"] is None and resumed["minutes"] > 0


def test_cpu_minutes_leave_out_a_pause(data_dir, tmp_path, monkeypatch):
    """``minutes`` is wall clock, ``cpu_minutes`` this process's CPU time: a run that sleeps (a paused
    job, a core lent to another) records the sleep in the first only."""
    import time

    real = __import__("energyformer.train.loop", fromlist=["x"])._Loop.evaluate

    def slow_evaluate(self, *a, **k):
        time.sleep(1.0)
        return real(self, *a, **k)

    monkeypatch.setattr("energyformer.train.loop._Loop.evaluate", slow_evaluate)
    s = train(tiny_cfg(data_dir, tmp_path / "run", max_steps=4), progress=False)
    assert s["minutes"] * 60 > 1.0 and s["cpu_minutes"] * 60 < s["minutes"] * 60 - 0.8


def test_data_identity_is_recorded_and_checked(data_dir, tmp_path):
    import shutil

    from energyformer.data import data_identity
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    out = tmp_path / "run"
    train(tiny_cfg(data, out, max_steps=2), progress=False)
    assert find_checkpoint(out)["data"] == data_identity(data)
    make_data_dir(data, seed=3)  # same characters, other text
    with pytest.raises(ValueError, match=r"differ from the data run .*: train\.bin changed"):
        train(tiny_cfg(data, out, max_steps=4), progress=False)
    assert find_checkpoint(out)["step"] == 2  # nothing lost


def test_activation_checkpointing_option_trains_the_same_run(data_dir, tmp_path):
    """train.activation_checkpointing recomputes activations; the run (losses, weights) is unchanged."""
    model = dict(arch="nrgpt", d_model=32, n_heads=2, n_steps=3)
    a = train(tiny_cfg(data_dir, tmp_path / "a", model=model, max_steps=6), progress=False)
    b = train(tiny_cfg(data_dir, tmp_path / "b", model=model, max_steps=6, activation_checkpointing=True),
              progress=False)
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["train_loss"] for r in ra] == pytest.approx([r["train_loss"] for r in rb], rel=1e-5)
    assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-5)


def test_an_allocation_failure_in_a_step_is_one_clear_error(data_dir, tmp_path, monkeypatch):
    """Activations are not in the size check before step 1: an impossible size shows in the first
    forward, and must read as one error naming what to change (not an allocator traceback)."""
    from energyformer.models.gpt import GPT

    def too_big(self, *a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 40000000000 bytes.")

    monkeypatch.setattr(GPT, "forward", too_big)
    with pytest.raises(ValueError, match=r"out of memory in training step 1 .*train\.batch_size \(now 8\)"):
        train(tiny_cfg(data_dir, tmp_path / "run", max_steps=2), progress=False)


def test_mfu_uses_the_measured_flops_of_the_model_once_per_run(data_dir, tmp_path, monkeypatch):
    """The loop's MFU is models/flops.py's measured count (which charges a recurrent model for
    every step), measured once per run, not a parameter-count rule."""
    from energyformer.models.flops import training_flops_per_token

    calls = []

    def counted(model, *a, **k):
        calls.append(training_flops_per_token(model, *a, **k))
        return calls[-1]

    monkeypatch.setattr(loop_mod, "training_flops_per_token", counted)
    monkeypatch.setattr(loop_mod, "peak_flops", lambda device: 1e12)
    model = dict(arch="nrgpt", d_model=32, n_heads=2, n_steps=3)
    s = train(tiny_cfg(data_dir, tmp_path / "run", model=model, max_steps=4, eval_iters=1), progress=False)
    assert len(calls) == 1
    assert s["mfu"] == pytest.approx(calls[0] * s["tokens_per_s"] / 1e12)
    assert calls[0] > 6 * s["params_non_embedding"]  # the shared block is charged for each of its 3 steps
    assert not hasattr(loop_mod, "estimate_flops_per_token")


def test_a_resume_stopped_before_its_end_leaves_no_stale_summary(data_dir, tmp_path, monkeypatch):
    """Resuming a finished run for more steps removes its summary.json at the start: a stop before
    the new end must not leave the previous segment's numbers looking like a finished run."""
    from energyformer.runs.layout import SUMMARY_FILE

    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, max_steps=2, eval_iters=1), progress=False)
    assert (run / SUMMARY_FILE).is_file()
    seen = []

    def stop(self, *a, **k):
        seen.append((run / SUMMARY_FILE).exists())
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod._Loop, "run", stop)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(data_dir, run, max_steps=4, eval_iters=1), progress=False)
    assert seen == [False] and not (run / SUMMARY_FILE).exists()
