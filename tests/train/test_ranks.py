"""Multi-rank logic of the training loop in fast unit tests, without torchrun: ranks faked by a
``DistInfo`` (or a stand-in with the same collectives) in one process, and FSDP2's DTensor
gradients on a one-rank gloo group. The slow two-process tests in test_distributed.py run the
same paths end to end; these catch the rank mix-ups in seconds:

- a resume with the saved number of ranks gives each rank its own RNG states (not rank 0's),
  another number reseeds every rank apart;
- FSDP2's gradient-norm clipping counts the replicated parameters' gradients with the sharded ones;
- a sharded checkpoint is written by every rank (rank 0 alone commits).
"""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist

from energyformer.runs import checkpoint as ckpt
from energyformer.runs.rng import rng_state, set_rng_state
from energyformer.train import distributed as dist
from energyformer.train import loop as loop_mod

# ---------------------------------------------------------------- RNG states on resume


def _rank_states(n):
    """``n`` distinct RNG states (what ``all_gather(rng_state())`` saved) and each one's next draw."""
    states, draws = [], []
    for r in range(n):
        torch.manual_seed(100 + r)
        states.append(rng_state())
        draws.append(torch.rand(4))
    return states, draws


def _restore(monkeypatch, rank, world_size, saved):
    """``_Loop.restore`` on ``rank`` of ``world_size`` for a checkpoint of step 6 whose ``rng`` is
    rank 0's states and ``rng_ranks`` is ``saved``; returns the rank's next draw."""
    # what the real restore_train_state does with the RNG: the process-wide state of rank 0
    monkeypatch.setattr(ckpt, "restore_train_state", lambda model, opt, gen, state, folder: set_rng_state(state["rng"]))
    tc = SimpleNamespace(seed=1337)
    fake = SimpleNamespace(model=None, optimizer=None, data_gen=None, tc=tc, depth=SimpleNamespace(load_state=dict),
                           info=dist.DistInfo(rank=rank, world_size=world_size), totals={"tokens": 0})
    state = {"step": 6, "best_val_loss": None, "extra": {}, "rng": saved[0], "rng_ranks": saved}
    loop_mod._Loop.restore(fake, state, Path("unused"))
    assert fake.step == 6
    return torch.rand(4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_same_size_resume_restores_each_ranks_own_rng_state(monkeypatch, world_size):
    saved, draws = _rank_states(world_size)
    for rank in range(world_size):
        assert torch.equal(_restore(monkeypatch, rank, world_size, saved), draws[rank]), rank


def test_a_resume_on_another_number_of_ranks_reseeds_each_rank_apart(monkeypatch):
    saved, draws = _rank_states(2)
    got = [_restore(monkeypatch, rank, 3, saved) for rank in range(3)]
    for rank in range(3):
        torch.manual_seed(1337 + 6 + rank)  # seed + step + rank
        assert torch.equal(got[rank], torch.rand(4)), rank
    assert not any(torch.equal(g, d) for g in got for d in draws)  # no rank reuses a saved stream


# ---------------------------------------------------------------- FSDP2's gradient norm


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group and its CPU device mesh (torn down after the test)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not tdist.is_initialized()
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        tdist.destroy_process_group()


def test_fsdp2_clipping_counts_the_replicated_gradients(one_rank_group):
    """Sharded (DTensor) gradients and the plain ones of the parameters FSDP2 leaves replicated make
    one global norm: sqrt(|sharded|² + |replicated|²); both kinds are scaled by the same factor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), one_rank_group, [Shard(0)]))
    model.gain = torch.nn.Parameter(torch.zeros(5))  # replicated (a 1-D scalar-like parameter)
    model.w.grad = distribute_tensor(torch.full((4, 3), 1.0), one_rank_group, [Shard(0)])
    model.gain.grad = torch.full((5,), 2.0)
    expected = math.sqrt(12 * 1.0 + 5 * 4.0)
    norm = dist.clip_grad_norm(model, math.inf, dist.DistInfo())  # no clipping: the norm only
    assert float(norm) == pytest.approx(expected)
    assert torch.equal(model.gain.grad, torch.full((5,), 2.0))
    norm = dist.clip_grad_norm(model, 1.0, dist.DistInfo())
    assert float(norm) == pytest.approx(expected)
    total = torch.cat([model.w.grad.full_tensor().flatten(), model.gain.grad.flatten()]).norm()
    assert float(total) == pytest.approx(1.0, rel=1e-5)
    scale = 1.0 / expected
    torch.testing.assert_close(model.gain.grad, torch.full((5,), 2.0 * scale))
    torch.testing.assert_close(model.w.grad.full_tensor(), torch.full((4, 3), scale))


# ---------------------------------------------------------------- sharded checkpoints


def test_every_rank_calls_the_sharded_save(monkeypatch, tmp_path):
    """Under FSDP2 with ``fsdp_checkpoint: sharded`` the loop's save reaches the sharded writer on
    every rank (each with its own ``is_main``), not only on rank 0; every rank's RNG states go in."""
    calls = []
    monkeypatch.setattr(ckpt, "save_sharded_checkpoint",
                        lambda *a, **kw: calls.append((kw["is_main"], kw["rng_ranks"])))
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a, **kw: pytest.fail("the full save under sharded"))
    tc = SimpleNamespace(parallel="fsdp", fsdp_checkpoint="sharded", max_steps=10)
    for rank in (0, 1):
        info = SimpleNamespace(rank=rank, world_size=2, enabled=True, is_main=rank == 0,
                               all_gather=lambda obj: [f"rng of rank {r}" for r in (0, 1)],
                               broadcast=lambda obj: obj, barrier=lambda: None)
        fake = SimpleNamespace(info=info, step=4, tc=tc, train_loss=2.0, totals={"train_time_s": 0.0, "tokens": 0,
                               "wall_s": 0.0, "cpu_s": 0.0}, _elapsed=lambda: {"wall_s": 0.0, "cpu_s": 0.0},
                               depth=SimpleNamespace(state=dict),
                               data=SimpleNamespace(identity={}), out_dir=tmp_path, model=None, optimizer=None,
                               best_val=1.0, data_gen=None)
        loop_mod._Loop.save(fake)
    assert calls == [(True, ["rng of rank 0", "rng of rank 1"]), (False, ["rng of rank 0", "rng of rank 1"])]


# ---------------------------------------------------------------- the log records


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_log_record_names_the_world_size_under_torchrun(world_size):
    """``compare`` counts a run in progress's tokens from metrics.jsonl: every record of a multi-rank
    run names the world size (one process: no key, as before)."""
    logged = []
    fake = SimpleNamespace(step=3, train_loss=2.5, flops_per_token=1.0, peak=None, last_depth=None, say=print,
                           tc=SimpleNamespace(max_steps=10), info=dist.DistInfo(rank=0, world_size=world_size))
    bar = SimpleNamespace(disable=False, set_postfix=lambda **kw: None)
    loop_mod._Loop.log(fake, SimpleNamespace(log=logged.append), bar, False, 1e-3, 0.5, 100.0, do_eval=False)
    (record,) = logged
    assert record.get("world_size") == (2 if world_size == 2 else None) and record["step"] == 3
