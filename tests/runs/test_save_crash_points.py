"""A crash before EVERY rename and unlink of a checkpoint save leaves a resumable run directory.

The kill points are not chosen by the code's structure: an audit hook (``sys.addaudithook``)
sees every ``os.rename``, ``os.replace``, ``os.remove``/``os.unlink`` and ``shutil.rmtree`` the
process performs while :func:`energyformer.runs.checkpoint.save_checkpoint` runs. A first save
records them; then, for each of them in turn, a fresh run directory with a committed checkpoint
saves again and a simulated crash (a ``BaseException`` raised by the hook, which aborts the
operation) stops the save just before that operation; every later file operation is refused as
well (a killed process performs none). Training's start (``clean_orphans``) and resume
(``restore_checkpoint``) must then find the old or the new checkpoint, with the weights of its
step, and a next save must commit. The same holds for the sharded save of FSDP2 runs
(``save_sharded_checkpoint``: DCP shards, here written by one process), with and without its
single-file export, and for a crash from a full checkpoint to a sharded one.
"""
import os
import sys

import pytest
import torch

from energyformer import build_model
from energyformer.runs import checkpoint
from energyformer.runs.config import load_config
from energyformer.train.optim import build_optimizer

EVENTS = ("os.rename", "os.replace", "os.remove", "shutil.rmtree")  # os.replace/os.unlink audit as rename/remove


class SimulatedCrash(BaseException):
    """Not an Exception: no ``except Exception`` / ``except OSError`` of the save may swallow it."""


class _Hook:
    """The one audit hook of this module (audit hooks cannot be removed): inactive unless armed."""

    def __init__(self):
        self.events, self.crash_at, self.crashed, self.active = [], None, False, False

    def __call__(self, event, args):
        if not self.active or event not in EVENTS:
            return
        if self.crashed:  # a killed process does nothing more
            raise SimulatedCrash(f"after the crash: {event}{args}")
        self.events.append((event, args))
        if self.crash_at is not None and len(self.events) - 1 == self.crash_at:
            self.crashed = True
            raise SimulatedCrash(f"before {event}{args}")

    def arm(self, crash_at=None):
        self.events, self.crash_at, self.crashed, self.active = [], crash_at, False, True


HOOK = _Hook()
sys.addaudithook(HOOK)


def _setup(out_dir):
    cfg = load_config({"model": dict(arch="gpt", vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2),
                       "data": {"root": str(out_dir / "no-data")}, "train": {"out_dir": str(out_dir)}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return cfg, model, build_optimizer(model, cfg.train)


def _train_step(model, opt):
    idx = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(len(opt.state) + 1))
    model(idx, idx)[1].backward()
    opt.step()
    opt.zero_grad()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save(kind, out_dir, model, opt, step, best, gen):
    if kind == "full":
        return checkpoint.save_checkpoint(out_dir, model, opt, step, best, gen)
    return checkpoint.save_sharded_checkpoint(out_dir, model, opt, step, best, gen, export=kind == "sharded+export")


def _committed_then_save(out_dir, new_step, crash_at, kinds=("full", "full")):
    """Commit step 3, train a step, save ``new_step`` with a crash before operation ``crash_at``
    (None: no crash); returns ``{step: [weights]}`` of both saves and the recorded events.
    ``kinds``: how the two saves are written (``full``, ``sharded``, ``sharded+export``)."""
    from energyformer.runs import rundir

    cfg, model, opt = _setup(out_dir)
    gen = torch.Generator().manual_seed(5)
    _train_step(model, opt)
    rundir.write_run_files(out_dir, cfg, {"format_version": 1, "tokenizer": "char", "vocab_size": 11,
                                          "chars": list("abcdefghijk"), "n_train": 100, "n_val": 10})
    _save(kinds[0], out_dir, model, opt, 3, 1.5, gen)
    expected = {3: [_weights(model)]}
    _train_step(model, opt)
    expected.setdefault(new_step, []).append(_weights(model))  # a re-save of step 3: either weights
    HOOK.arm(crash_at)
    try:
        _save(kinds[1], out_dir, model, opt, new_step, 1.25, gen)
    except SimulatedCrash:
        pass
    finally:
        HOOK.active = False
    assert HOOK.crashed == (crash_at is not None), "the save performed fewer file operations than recorded"
    return expected, list(HOOK.events)


def _check_resumable(out_dir, expected, kinds=("full", "full")):
    checkpoint.clean_orphans(out_dir)  # what training does on start, under the run dir's lock
    marker = checkpoint.find_checkpoint(out_dir)
    assert marker is not None, f"no complete checkpoint left: {sorted(p.name for p in out_dir.rglob('*'))}"
    _, model, opt = _setup(out_dir)
    state = checkpoint.restore_checkpoint(out_dir, model, opt, torch.Generator())
    step = state["step"]
    assert step in expected
    loaded = model.state_dict()
    assert any(all(torch.equal(loaded[k], v) for k, v in weights.items()) for weights in expected[step]), \
        f"the weights of step {step} are not the ones saved at that step"
    _, plain, _ = _setup(out_dir)  # what load_run reads: the export, the shards or the full file
    checkpoint.load_checkpoint_weights(plain, out_dir)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in loaded.items())
    top = out_dir / "model.safetensors"  # the top-level link is the committed weights or absent
    folder = checkpoint.checkpoint_dir(out_dir)
    assert (top.exists() and os.path.samefile(top, folder / "model.safetensors")) or \
        (not top.exists() and not (folder / "model.safetensors").exists())
    # the next save commits, and its folder is the only one left
    _save(kinds[1], out_dir, model, opt, 9, None, torch.Generator())
    assert checkpoint.find_checkpoint(out_dir)["step"] == 9
    assert [p.name for p in (out_dir / "checkpoints").iterdir()] == ["step-00000009"]


@pytest.mark.parametrize("new_step,kinds", [(4, ("full", "full")), (3, ("full", "full")),
                                            (4, ("sharded", "sharded")), (3, ("sharded", "sharded+export")),
                                            (4, ("full", "sharded"))],
                         ids=["next step", "same step again", "sharded", "sharded, same step, export",
                              "full then sharded"])
def test_a_crash_before_every_rename_and_unlink_of_a_save_is_resumable(tmp_path, new_step, kinds):
    _, events = _committed_then_save(tmp_path / "record", new_step, None, kinds)
    seen_kinds = {e for e, _ in events}
    assert {"os.rename", "os.remove", "shutil.rmtree"} <= seen_kinds, events  # (os.replace audits as os.rename)
    for k, (event, args) in enumerate(events):
        out_dir = tmp_path / f"crash-{k}"
        expected, seen = _committed_then_save(out_dir, new_step, k, kinds)
        assert [e for e, _ in seen] == [e for e, _ in events[:k + 1]]
        try:
            _check_resumable(out_dir, expected, kinds)
        except AssertionError as e:
            raise AssertionError(f"crash before operation {k} of {len(events)} ({event} {args}): {e}") from None
