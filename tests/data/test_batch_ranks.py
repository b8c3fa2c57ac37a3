"""The training batch stream across ranks (``energyformer.data.BatchSampler``), ranks faked in one
process: W ranks with A accumulation steps see exactly the windows of one process with W·A, each
rank its own (never rank 0's), and one saved generator state resumes every rank."""
import numpy as np
import pytest
import torch

from energyformer.data import BatchSampler

DATA = np.arange(500, dtype=np.uint16) % 37


def _stream(rank, world_size, accum, steps, seed=5):
    gen = torch.Generator().manual_seed(seed)
    sampler = BatchSampler(DATA, 3, 8, gen, rank=rank, world_size=world_size)
    return [sampler.next_step(accum) for _ in range(steps)], gen


@pytest.mark.parametrize("world_size,accum", [(2, 1), (2, 3), (3, 2)])
def test_ranks_split_the_windows_of_one_process(world_size, accum):
    one, _ = _stream(0, 1, world_size * accum, steps=3)
    ranks = [_stream(r, world_size, accum, steps=3)[0] for r in range(world_size)]
    for step in range(3):
        together = [mb for r in range(world_size) for mb in ranks[r][step]]  # rank 0's, then rank 1's, ...
        assert len(together) == len(one[step]) == world_size * accum
        for (x, y), (x1, y1) in zip(together, one[step]):
            assert torch.equal(x, x1) and torch.equal(y, y1)
    firsts = [ranks[r][0][0][0] for r in range(world_size)]
    assert all(not torch.equal(firsts[0], f) for f in firsts[1:])  # no rank draws rank 0's batches


def test_one_saved_generator_state_resumes_every_rank():
    for rank in range(2):
        whole, _ = _stream(rank, 2, 2, steps=4)
        _, gen = _stream(rank, 2, 2, steps=2)
        state = gen.get_state()
        other = torch.Generator().manual_seed(999)
        other.set_state(state)
        rest = [BatchSampler(DATA, 3, 8, other, rank=rank, world_size=2).next_step(2) for _ in range(2)]
        for got, want in zip(rest, whole[2:]):
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank"):
        BatchSampler(DATA, 3, 8, torch.Generator(), rank=2, world_size=2)
