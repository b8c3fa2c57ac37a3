"""``estimate_loss`` on several ranks, faked in one process: rank r evaluates batches r, r + W, ...
(every rank as many forwards, padded with weight-0 batches), and the sum over ranks divided by
``eval_iters`` is the mean of one process over the same batches."""
import numpy as np
import pytest
import torch

from energyformer.eval.loss import estimate_loss

DATA = {"val": np.arange(400, dtype=np.uint16) % 23, "train": (np.arange(400, dtype=np.uint16) * 7) % 23}


class _Recorder(torch.nn.Module):
    """A loss that depends on the batch (its mean token id), remembering the batches it saw."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, y):
        self.seen.append(x.clone())
        return None, x.float().mean() / 10 + y.float().std()


@pytest.mark.parametrize("world_size,eval_iters", [(2, 4), (3, 4), (4, 3)])
def test_ranks_share_the_batches_of_one_process(world_size, eval_iters):
    kw = dict(eval_iters=eval_iters, batch_size=2, block_size=8, seed=11)
    one = _Recorder()
    want = estimate_loss(one, DATA, **kw)
    totals = {name: 0.0 for name in DATA}
    forwards, seen = [], []
    for rank in range(world_size):
        model, sums = _Recorder(), []
        estimate_loss(model, DATA, rank=rank, world_size=world_size,
                      all_reduce=lambda t, s=sums: s.append(t) or t, **kw)
        for name, total in zip(DATA, sums):  # what this rank adds to the all-reduce
            totals[name] += total
        forwards.append(len(model.seen))
        seen.append(model.seen)
    assert len(set(forwards)) == 1  # the same number of forwards on every rank (sharded models need it)
    for name in DATA:
        assert totals[name] / eval_iters == pytest.approx(want[name], rel=1e-12)
    per_rank = forwards[0] // len(DATA)
    for j in range(eval_iters):  # batch j of the val split is evaluated by rank j % W, as one process
        assert torch.equal(seen[j % world_size][j // world_size], one.seen[j])
    assert per_rank == -(-eval_iters // world_size)
