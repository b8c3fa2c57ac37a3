"""Activation checkpointing (energyformer.train.parallelize.apply_activation_checkpointing): the same loss and
gradients, and activation memory that no longer grows with the number of descent steps.

Memory is measured exactly as the bytes of the tensors autograd saves for the backward pass
(torch.autograd.graph.saved_tensors_hooks), which is what checkpointing trades for compute."""
import pytest
import torch

from energyformer.models.registry import LANGUAGE_MODELS, build_model
from energyformer.train.parallelize import apply_activation_checkpointing

V, N = 64, 64


def _model(arch, **kw):
    torch.manual_seed(0)
    return build_model(dict(arch=arch, vocab_size=V, block_size=N, d_model=64, n_heads=4, **kw))


def _saved_bytes_and_grads(model, idx):
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:  # count each storage once (views share it)
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total[0], loss.detach(), grads


@pytest.mark.parametrize("arch,kw", [(a, {}) for a in LANGUAGE_MODELS] + [
    ("cem", dict(n_steps=4, interaction="diag_shared", preconditioner="diag_lowrank", preconditioner_rank=4)),
    ("nrgpt", dict(n_steps=4, attention="factored"))])
def test_checkpointing_gives_the_same_loss_and_gradients(arch, kw):
    idx = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    model = _model(arch, **kw)
    _, loss, grads = _saved_bytes_and_grads(model, idx)
    _, loss_ck, grads_ck = _saved_bytes_and_grads(apply_activation_checkpointing(model), idx)
    torch.testing.assert_close(loss_ck, loss)
    assert grads.keys() == grads_ck.keys()
    for name in grads:
        torch.testing.assert_close(grads_ck[name], grads[name], msg=name)


@pytest.mark.parametrize("arch", ["cem", "nrgpt", "gpt_rec"])
def test_t4_with_checkpointing_saves_at_most_1_3_times_t1(arch):
    """The issue's goal: per-step checkpointing at T = 4 keeps activation memory within 1.3× of T = 1."""
    idx = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    depth = {"cem": dict(n_layers=2), "nrgpt": {}, "gpt_rec": {}}[arch]
    t1, _, _ = _saved_bytes_and_grads(_model(arch, n_steps=1, **depth), idx)
    t4, _, _ = _saved_bytes_and_grads(_model(arch, n_steps=4, **depth), idx)
    t4_ck, _, _ = _saved_bytes_and_grads(apply_activation_checkpointing(_model(arch, n_steps=4, **depth)), idx)
    assert t4 > 2 * t1  # without checkpointing memory grows with T
    assert t4_ck <= 1.3 * t1, (t1, t4, t4_ck)


def test_no_checkpointing_without_gradients_or_in_eval():
    model = apply_activation_checkpointing(_model("nrgpt"))
    idx = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        a = model(idx)[0]
    model.eval()
    torch.testing.assert_close(model(idx)[0], a)
