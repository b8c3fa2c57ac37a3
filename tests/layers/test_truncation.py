"""Truncated back-propagation through recurrent steps (layers/truncation.py) in every recurrent
family: NRGPT, GPT_Rec / GPT_Rec_parallel and CEM's steps inside a layer.

- ``backprop_steps=k`` with ``k ≥ depth`` gives exactly the gradients of full back-propagation
  (float64, bit for bit), and never changes the forward;
- with ``k < depth`` the gradients are those of a reference that runs the first ``depth − k``
  steps under ``torch.no_grad()`` by hand;
- the activation memory kept for the backward (bytes of the saved tensors) does not grow with
  the depth at a fixed ``k``, and grows without truncation;
- CEM with per-step activation checkpointing truncates the same way.
"""
import pytest
import torch

from energyformer import build_model
from energyformer.layers.truncation import first_graph_step, step_grad_mode

V, N = 11, 8
FAMILIES = {
    "nrgpt": {"arch": "nrgpt", "d_model": 16, "n_heads": 2, "n_steps": 3},
    "gpt_rec": {"arch": "gpt_rec", "d_model": 16, "n_heads": 2, "n_steps": 3},
    "gpt_rec_parallel": {"arch": "gpt_rec", "d_model": 16, "n_heads": 2, "n_steps": 3, "parallel": True},
    "cem": {"arch": "cem", "d_model": 16, "n_heads": 2, "n_layers": 2, "n_steps": 3,
            "preconditioner": "diag_lowrank", "preconditioner_rank": 2},
}


def _model(name, **kw):
    torch.manual_seed(0)
    return build_model({"vocab_size": V, "block_size": 16, **FAMILIES[name], **kw}).double().train()


def _idx(seed=1):
    return torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(seed))


def _grads(model, **kw):
    model.zero_grad(set_to_none=True)
    idx = _idx()
    logits, loss = model(idx, targets=idx, **kw)
    loss.backward()
    return logits.detach(), {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, name
        else:
            assert torch.equal(a[name], b[name]), name


def test_first_graph_step_and_its_errors():
    assert first_graph_step(5, None) == 0
    assert first_graph_step(5, 2) == 3
    assert first_graph_step(5, 5) == first_graph_step(5, 9) == 0
    with pytest.raises(ValueError, match="backprop_steps=0 must be >= 1"):
        first_graph_step(5, 0)
    with pytest.raises(ValueError, match="backprop_steps=2.5 must be an integer"):
        first_graph_step(5, 2.5)
    with step_grad_mode(0, 1):
        assert not torch.is_grad_enabled()
    with step_grad_mode(1, 1):
        assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("depth", [None, 5])
def test_k_at_least_the_depth_is_full_backpropagation_exactly(name, depth):
    model = _model(name)
    kw = {} if depth is None else {"n_steps": depth}
    steps = depth or FAMILIES[name]["n_steps"]
    logits, full = _grads(model, **kw)
    for k in (steps, steps + 3):
        logits_k, truncated = _grads(model, backprop_steps=k, **kw)
        assert torch.equal(logits, logits_k)
        _assert_same(full, truncated)


def _reference_recurrent(model, name, depth, k):
    """The truncation by hand for the models with one shared block: the embeddings, then the
    first depth − k block applications without a graph, then the last k with one."""
    idx = _idx()
    x = model.embed(idx)
    with torch.no_grad():
        for t in range(depth - k):
            x = model.block(x, model.step_scale(t)) if name == "nrgpt" else model.block(x)
    for t in range(depth - k, depth):
        x = model.block(x, model.step_scale(t)) if name == "nrgpt" else model.block(x)
    logits = model.lm_head(model.ln_f(x))
    model.zero_grad(set_to_none=True)
    model.lm_loss(logits, idx).backward()
    return logits.detach(), {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _reference_cem(model, depth, k):
    """The truncation by hand inside every CEM sub-block: the context from the sub-block input
    with a graph, the first depth − k steps without one, the norm of the detached state and the
    last k steps with one."""
    def sub_block(sub, x):
        h_hat = sub._normalize(x)
        ctx = sub._context(h_hat)
        g = h_hat
        with torch.no_grad():
            for t in range(depth - k):
                x = sub._descend(x, sub._grad(g, h_hat, ctx), t)
                g = sub._normalize(x)
        g = sub._normalize(x)
        for t in range(depth - k, depth):
            x = sub._descend(x, sub._grad(g, h_hat, ctx), t)
            g = sub._normalize(x)
        return x

    idx = _idx()
    x = model.embed(idx)
    for block in model.blocks:
        x = sub_block(block.mlp, sub_block(block.attn, x))
    logits = model.lm_head(model.norm(x))
    model.zero_grad(set_to_none=True)
    model.lm_loss(logits, idx).backward()
    return logits.detach(), {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_truncation_keeps_a_graph_for_the_last_k_steps_only(name):
    model = _model(name)
    depth, k = 5, 2
    logits, truncated = _grads(model, n_steps=depth, backprop_steps=k)
    ref_logits, ref = (_reference_cem(model, depth, k) if name == "cem"
                       else _reference_recurrent(model, name, depth, k))
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
    assert truncated.keys() == ref.keys()
    for n in ref:
        assert (truncated[n] is None) == (ref[n] is None), n
        if ref[n] is not None:
            torch.testing.assert_close(truncated[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)
    _, full = _grads(model, n_steps=depth)
    assert any(not torch.allclose(full[n], truncated[n]) for n in full if truncated[n] is not None)
    if name != "cem":  # the detached state: the embeddings get no gradient (CEM's contexts keep one)
        assert truncated["wte.weight"] is None and truncated["wpe.weight"] is None


def test_cem_truncation_with_per_step_checkpointing_gives_the_same_gradients():
    from energyformer.train.parallelize import apply_activation_checkpointing

    plain = _grads(_model("cem"), n_steps=5, backprop_steps=2)
    checkpointed = _model("cem")
    apply_activation_checkpointing(checkpointed)
    again = _grads(checkpointed, n_steps=5, backprop_steps=2)
    torch.testing.assert_close(again[0], plain[0], rtol=0, atol=0)
    for n in plain[1]:
        torch.testing.assert_close(again[1][n], plain[1][n], rtol=1e-12, atol=1e-14, msg=n)


def _saved_bytes(model, **kw):
    """Bytes of the tensors autograd saves in one forward (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.add((ptr, t.untyped_storage().nbytes()))
        return t

    idx = _idx()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets=idx, **kw)
    return sum(nbytes for _, nbytes in seen)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_activation_memory_is_flat_in_the_depth_for_a_fixed_k(name):
    model = _model(name)
    truncated = [_saved_bytes(model, n_steps=d, backprop_steps=2) for d in (2, 4, 8)]
    full = [_saved_bytes(model, n_steps=d) for d in (2, 4, 8)]
    assert truncated[0] == full[0]  # k = depth: nothing is truncated
    assert truncated[1] == truncated[2], truncated
    assert full[2] > full[1] > full[0], full


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_backprop_steps_is_for_training_not_with_a_cache(name):
    model = _model(name).eval()
    with pytest.raises(ValueError, match="backprop_steps=1 is for training; call without a cache"):
        model(_idx(), cache=model.new_cache(), backprop_steps=1)
    with pytest.raises(ValueError, match="backprop_steps=0 must be >= 1"):
        model(_idx(), backprop_steps=0)
