"""Checkpoints: safetensors round trip (tied weights, wrapper prefixes), weights-only train state,
RNG states (CUDA ones with fewer devices), atomic writes, torn/corrupt/missing files and load_run errors."""
import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from energyformer import build_model
from energyformer.runs import checkpoint, rng, rundir, weights
from energyformer.runs.config import load_config
from energyformer.train.optim import build_optimizer
from energyformer.utils import io

META = {"format_version": 1, "tokenizer": "char", "vocab_size": 11, "chars": list("abcdefghijk"),
        "n_train": 100, "n_val": 10}


def run_cfg(out_dir, **model_kw):
    model = dict(arch="gpt", vocab_size=11, block_size=8, d_model=16, n_layers=2, n_heads=2)
    model.update(model_kw)
    # data.root points into out_dir: no data dir there, so the meta.json fallback of load_run
    # never finds a real prepared dataset in the working directory
    return load_config({"model": model, "data": {"root": str(Path(out_dir) / "no-data")},
                        "train": {"out_dir": str(out_dir)}})


def write_checkpoint(out_dir, step=3, **model_kw):
    """A complete checkpoint of a (slightly trained) tiny GPT; returns (model, optimizer, generator)."""
    cfg = run_cfg(out_dir, **model_kw)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.train)
    idx = torch.randint(0, 11, (2, 8))
    for _ in range(2):
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    gen = torch.Generator().manual_seed(5)
    rundir.write_run_files(out_dir, cfg, META)
    checkpoint.save_checkpoint(out_dir, model, opt, step, 1.25, gen)
    return model, opt, gen


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_gives_identical_logits(tmp_path, tie):
    model, _, _ = write_checkpoint(tmp_path, tie_embeddings=tie)
    loaded, cfg, meta = rundir.load_run(tmp_path)
    assert meta == META and cfg.model == model.config
    idx = torch.randint(0, 11, (3, 8))
    model.eval()
    torch.testing.assert_close(loaded(idx)[0], model(idx)[0], atol=0, rtol=0)
    assert not loaded.training
    tensors, metadata = weights.read_weights(tmp_path / "model.safetensors")
    assert metadata["step"] == "3"
    if tie:  # stored once, restored as one Parameter
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
        assert len(stored) == len(model.state_dict()) - 1
        assert loaded.lm_head.weight is loaded.wte.weight
        assert json.loads(metadata["aliases"]) in ({"lm_head.weight": "wte.weight"},
                                                   {"wte.weight": "lm_head.weight"})


def test_wrapper_prefixes_are_not_saved(tmp_path):
    class Wrapper(nn.Module):  # what torch.compile's OptimizedModule looks like
        def __init__(self, m):
            super().__init__()
            self._orig_mod = m

    model = build_model(run_cfg(tmp_path).model)
    path = weights.save_weights(Wrapper(model), tmp_path / "w.safetensors")
    tensors, _ = weights.read_weights(path)
    assert set(tensors) == set(model.state_dict())
    assert weights.strip_wrapper_prefixes("module._orig_mod.blocks.0.w") == "blocks.0.w"
    fresh = build_model(run_cfg(tmp_path).model)
    weights.load_weights(Wrapper(fresh), path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k])


def test_train_state_is_weights_only_and_restores_everything(tmp_path):
    model, opt, gen = write_checkpoint(tmp_path)
    state = torch.load(tmp_path / "checkpoints/step-00000003/train_state.pt", weights_only=True)
    assert state["step"] == 3 and state["best_val_loss"] == 1.25
    assert {"optimizer", "rng", "data_generator", "format_version"} <= set(state)
    marker = checkpoint.find_checkpoint(tmp_path)
    assert marker["step"] == 3 and all((tmp_path / f).is_file() for f in marker["files"])
    assert marker["dir"] == "checkpoints/step-00000003"
    # the top-level weights are the committed ones (a hard link)
    assert os.path.samefile(tmp_path / "model.safetensors", tmp_path / marker["dir"] / "model.safetensors")

    model2 = build_model(model.config)
    opt2 = build_optimizer(model2, run_cfg(tmp_path).train)
    gen2 = torch.Generator().manual_seed(123)
    checkpoint.restore_checkpoint(tmp_path, model2, opt2, gen2)
    assert torch.equal(gen2.get_state(), gen.get_state())
    # the optimizer state is keyed by parameter names (loads under one process, DDP or FSDP2)
    assert all(isinstance(k, str) for k in state["optimizer"]["state"])
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name])


def test_rng_state_round_trip():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = rng.rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    rng.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_cuda_rng_states_restore_with_fewer_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one visible CUDA device, faked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, int(s[0]))))
    monkeypatch.setattr(rng, "_warned_cuda", [])
    state = {**rng.rng_state(), "cuda": [torch.full((4,), 7, dtype=torch.uint8),
                                          torch.full((4,), 9, dtype=torch.uint8)]}
    with pytest.warns(UserWarning, match="CUDA RNG states of 2 devices but 1 are visible"):
        rng.set_rng_state(state)
    assert restored == [(0, 7)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        rng.set_rng_state(state)
    assert restored == [(0, 7), (0, 7)]


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    io.atomic_write_text(path, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        io.atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]  # no temp file left


def test_no_temp_files_after_checkpoint(tmp_path):
    write_checkpoint(tmp_path)
    write_checkpoint(tmp_path, step=4)  # a newer checkpoint replaces the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.yaml", "meta.json", "model.safetensors", "checkpoints", "checkpoint.json"])
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]
    assert checkpoint.find_checkpoint(tmp_path)["step"] == 4
    write_checkpoint(tmp_path, step=4)  # the same step again: written beside, then switched
    assert checkpoint.find_checkpoint(tmp_path)["dir"] == "checkpoints/step-00000004.1"
    assert len(list((tmp_path / "checkpoints").iterdir())) == 1


def test_find_checkpoint_incomplete(tmp_path):
    assert checkpoint.find_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path)
    (tmp_path / "checkpoints/step-00000003/train_state.pt").unlink()
    assert checkpoint.find_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint.json").write_text("{not json")
    assert checkpoint.find_checkpoint(tmp_path) is None


def test_format_1_run_directories_still_load_and_resume(tmp_path):
    """Weights and train state at the top level, listed by the marker (version 0.2 layout)."""
    model, opt, gen = write_checkpoint(tmp_path, step=3)
    d = tmp_path / "checkpoints/step-00000003"
    (tmp_path / "model.safetensors").unlink()
    os.replace(d / "model.safetensors", tmp_path / "model.safetensors")
    state = torch.load(d / "train_state.pt", weights_only=True)
    state["optimizer"] = opt.state_dict()  # format 1: positional optimizer state
    state["format_version"] = 1
    torch.save(state, tmp_path / "train_state.pt")
    (d / "train_state.pt").unlink()
    d.rmdir()
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"format_version": 1, "step": 3, "best_val_loss": 1.25,
         "files": ["config.yaml", "meta.json", "model.safetensors", "train_state.pt"]}))
    loaded, _, _ = rundir.load_run(tmp_path)
    model2 = build_model(model.config)
    opt2 = build_optimizer(model2, run_cfg(tmp_path).train)
    assert checkpoint.restore_checkpoint(tmp_path, model2, opt2, torch.Generator())["step"] == 3
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_torn_checkpoint_is_detected(tmp_path):
    model, opt, gen = write_checkpoint(tmp_path, step=3)
    marker = json.loads((tmp_path / "checkpoint.json").read_text())
    marker["step"] = 5  # as if the weights/state of step 5 had not both landed
    (tmp_path / "checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="inconsistent"):
        checkpoint.restore_checkpoint(tmp_path, model, opt, gen)


def test_orphans_of_interrupted_saves_are_cleaned(tmp_path):
    write_checkpoint(tmp_path, step=3)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-00000005-abc").mkdir()
    (root / ".tmp-step-00000005-abc" / "model.safetensors").write_bytes(b"half")
    (root / "step-00000005").mkdir()  # renamed, never committed
    (tmp_path / ".model.safetensors.x1y2.tmp").write_bytes(b"half")
    (tmp_path / "model.safetensors").unlink()  # killed between commit and re-link
    removed = checkpoint.clean_orphans(tmp_path)
    assert sorted(removed) == [".model.safetensors.x1y2.tmp", "checkpoints/.tmp-step-00000005-abc",
                               "checkpoints/step-00000005"]
    assert [p.name for p in root.iterdir()] == ["step-00000003"]
    assert os.path.samefile(tmp_path / "model.safetensors", root / "step-00000003/model.safetensors")
    rundir.load_run(tmp_path)


def test_a_failed_save_keeps_the_committed_checkpoint(tmp_path, monkeypatch):
    model, opt, gen = write_checkpoint(tmp_path, step=3)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save_checkpoint(tmp_path, model, opt, 4, None, gen)
    monkeypatch.undo()
    assert checkpoint.find_checkpoint(tmp_path)["step"] == 3
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]


def test_run_dir_lock(tmp_path):
    with rundir.lock_run_dir(tmp_path / "run"):
        # flock is per open file description: a second open in this process is refused too
        with pytest.raises(rundir.RunDirLockedError, match=f"in use by another training \\(pid {os.getpid()}\\)"):
            with rundir.lock_run_dir(tmp_path / "run"):
                pass
    with rundir.lock_run_dir(tmp_path / "run"):  # released
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        with rundir.lock_run_dir(tmp_path / "file"):
            pass


def test_load_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory .* does not exist"):
        rundir.load_run(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        rundir.load_run(tmp_path)

    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file; expected a run directory"):
        rundir.load_run(tmp_path / "afile")
    (tmp_path / "afile").unlink()

    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # load_run reads the committed weights
    weights = tmp_path / "checkpoints/step-00000003/model.safetensors"
    good = weights.read_bytes()

    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        rundir.load_run(tmp_path)

    weights.write_bytes(b"\x00garbage that is not a safetensors header")
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        rundir.load_run(tmp_path)

    weights.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        rundir.load_run(tmp_path)

    weights.write_bytes(good)
    rundir.load_run(tmp_path)  # intact again
    cfg = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(cfg.replace("d_model: 16", "d_model: 32"))
    with pytest.raises(ValueError, match="do not match.*shape mismatch"):
        rundir.load_run(tmp_path)
    (tmp_path / "config.yaml").write_text(cfg.replace("n_layers: 2", "n_layers: 1"))
    with pytest.raises(ValueError, match=r"unexpected \[blocks\.1\."):
        rundir.load_run(tmp_path)
    (tmp_path / "config.yaml").write_text(cfg.replace("n_layers: 2", "n_layers: 3"))
    with pytest.raises(ValueError, match=r"missing \[blocks\.2\."):
        rundir.load_run(tmp_path)

    (tmp_path / "config.yaml").write_text(cfg)
    (tmp_path / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        rundir.load_run(tmp_path)


def test_corrupt_train_state(tmp_path):
    model, opt, gen = write_checkpoint(tmp_path)
    path = tmp_path / "checkpoints/step-00000003/train_state.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="train_state.pt.*corrupt"):
        checkpoint.restore_checkpoint(tmp_path, model, opt, gen)


def test_foreign_train_state_and_pickles(tmp_path):
    """A train state of another program, or one with arbitrary objects: one clear line, never
    advice to load it unsafely."""
    model, opt, gen = write_checkpoint(tmp_path)
    path = tmp_path / "checkpoints/step-00000003/train_state.pt"
    torch.save({"epoch": 3, "model": {}}, path)
    with pytest.raises(ValueError, match=r"not written by energyformer \(missing keys \['format_version', 'step'"):
        checkpoint.restore_checkpoint(tmp_path, model, opt, gen)
    torch.save({"step": 3, "payload": Path("x")}, path)  # a pickled class the safe loader refuses
    with pytest.raises(ValueError) as err:
        checkpoint.restore_checkpoint(tmp_path, model, opt, gen)
    assert "holds objects other than tensors" in str(err.value)
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)
    # a plain pickle: torch warns ("Detected pickle protocol 4") before refusing it; the user sees
    # only our line (the CLI prints each warning as a line of its own)
    import pickle
    import warnings

    with open(path, "wb") as f:
        pickle.dump({"step": 3, "payload": Path("x")}, f, protocol=4)
    with warnings.catch_warnings(record=True) as said, pytest.raises(ValueError, match="holds objects other than"):
        warnings.simplefilter("always")
        checkpoint.restore_checkpoint(tmp_path, model, opt, gen)
    assert [str(w.message) for w in said] == []


def test_checkpoint_files_get_the_umask_mode_not_0600(tmp_path):
    """Weights and train state are readable as any other file the process writes (0o666 & ~umask),
    and the step folder as any other folder (0o777 & ~umask)."""
    old = os.umask(0o022)
    try:
        write_checkpoint(tmp_path)
    finally:
        os.umask(old)
    folder = checkpoint.checkpoint_dir(tmp_path)
    assert folder != tmp_path
    assert (folder.stat().st_mode & 0o777) == 0o755
    for path in (folder / "model.safetensors", folder / "train_state.pt", tmp_path / "model.safetensors",
                 tmp_path / "checkpoint.json"):
        assert (path.stat().st_mode & 0o777) == 0o644, (path, oct(path.stat().st_mode))


@pytest.mark.parametrize("tie", [False, True])
def test_a_sharded_checkpoint_loads_and_resumes_in_one_process(tmp_path, tie):
    """The DCP folder of a sharded save (here written by one process) gives load_run the saved
    weights (tied ones too) and restore_checkpoint the optimizer state; no weights file is left."""
    model, opt, gen = write_checkpoint(tmp_path, tie_embeddings=tie)
    checkpoint.save_sharded_checkpoint(tmp_path, model, opt, 4, 1.0, gen)
    folder = checkpoint.checkpoint_dir(tmp_path)
    assert not (tmp_path / "model.safetensors").exists() and not (folder / "model.safetensors").exists()
    rel = f"checkpoints/{folder.name}"
    assert checkpoint.find_checkpoint(tmp_path)["files"][2:] == [f"{rel}/dcp/.metadata", f"{rel}/train_state.pt"]
    loaded, _, _ = rundir.load_run(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    fresh = build_model(run_cfg(tmp_path, tie_embeddings=tie).model)
    fresh_opt = build_optimizer(fresh, run_cfg(tmp_path).train)
    state = checkpoint.restore_checkpoint(tmp_path, fresh, fresh_opt, torch.Generator())
    assert state["step"] == 4 and state["optimizer"] is None
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(fresh_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"], rtol=0, atol=0, msg=name)


def test_corrupt_shards_are_one_error_naming_the_folder(tmp_path):
    model, opt, gen = write_checkpoint(tmp_path)
    checkpoint.save_sharded_checkpoint(tmp_path, model, opt, 4, 1.0, gen)
    shard = checkpoint.checkpoint_dir(tmp_path) / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"sharded checkpoint '.*dcp' is unreadable or does not match") as e:
        rundir.load_run(tmp_path)
    assert "\n" not in str(e.value)


def test_every_rank_writes_its_shards_into_the_folder_rank_0_made(tmp_path, monkeypatch):
    """A sharded save on two ranks, faked in one process: rank 1 runs its whole save while rank 0
    waits in the broadcast of the folder it made. Both write shards into that one folder (no rank
    is skipped), rank 1 returns None and commits nothing, rank 0 commits after every rank wrote."""
    model, opt, gen = write_checkpoint(tmp_path)
    writes, real_save = [], checkpoint.sharded.save_shards
    monkeypatch.setattr(checkpoint.sharded, "save_shards",  # rank 0 writes the real files
                        lambda p, m, o: (writes.append((rank[0], Path(p))), rank[0] == 0 and real_save(p, m, o)))
    rank, other = [0], []

    def broadcast(made):  # rank 0's folder reaches rank 1, which saves before rank 0 goes on
        assert not writes and checkpoint.find_checkpoint(tmp_path)["step"] == 3  # nothing written yet
        rank[0] = 1
        other.append(checkpoint.save_sharded_checkpoint(tmp_path, model, opt, 4, 1.0, gen, is_main=False,
                                                        broadcast=lambda _: made))
        assert checkpoint.find_checkpoint(tmp_path)["step"] == 3  # rank 1 commits nothing
        rank[0] = 0
        return made

    marker = checkpoint.save_sharded_checkpoint(tmp_path, model, opt, 4, 1.0, gen, is_main=True, broadcast=broadcast)
    assert other == [None] and marker is not None and checkpoint.find_checkpoint(tmp_path)["step"] == 4
    assert [r for r, _ in writes] == [1, 0] and writes[0][1] == writes[1][1]  # one folder, every rank
    assert writes[0][1].name == "dcp" and writes[0][1].parent.name.startswith(".tmp-")
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
