"""torch.compile(model, fullgraph=True) traces every family's forward and backward without a graph
break (dynamo with the eager backend: no code generation, so the test stays fast), and the
compiled step equals the eager one."""
import pytest
import torch

from energyformer.models.registry import LANGUAGE_MODELS, build_model

V, N = 50, 16
CASES = [dict(arch=a) for a in LANGUAGE_MODELS] + [
    dict(arch="cem", n_steps=2, interaction="diag_shared", preconditioner="diag_lowrank", preconditioner_rank=4),
    dict(arch="cem", interaction="diag_per_head", rope="llama"),
    dict(arch="nrgpt", attention="factored", eta_param="c_diag_gamma", ff="ff1"),
    dict(arch="nrgpt", mask="inclusive", per_step_scale=True),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fullgraph_forward_and_backward_equal_eager(cfg):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(dict(vocab_size=V, block_size=N, d_model=32, n_heads=4, **cfg))
    idx = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # raises on any graph break
    _, closs = compiled(idx, idx)
    closs.backward()
    torch.testing.assert_close(closs, loss)
    for n, p in model.named_parameters():
        if n in eager:
            torch.testing.assert_close(p.grad, eager[n], msg=n)


def test_eager_calls_still_check_ids():
    model = build_model(dict(arch="gpt", vocab_size=V, block_size=N, d_model=32, n_heads=4))
    with pytest.raises(ValueError, match="token id 50 is out of range"):
        model(torch.full((1, 4), V))
