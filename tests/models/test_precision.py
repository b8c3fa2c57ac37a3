"""bf16 autocast on CPU against float32 for every model family (loss within 1%), and the fused
energy gradients in bf16 against their float32 values with ratio-based tolerances."""
import pytest
import torch

from energyformer.energies import nrgpt as E
from energyformer.models.registry import ARCHS, build_model

V, N = 64, 32
FAMILIES = {
    "gpt": dict(n_layers=2), "llama": dict(n_layers=2), "gpt_rec": dict(n_steps=3, parallel=True),
    "cem": dict(n_layers=2, n_steps=2, interaction="diag_shared", preconditioner="diag_lowrank",
                preconditioner_rank=4),
    "nrgpt": dict(n_steps=3),
}


def test_every_family_is_listed():
    assert set(FAMILIES) == set(ARCHS) - {"regressor"}  # continuous inputs: not a token model


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_bf16_autocast_loss_is_within_one_percent_of_float32(arch):
    torch.manual_seed(0)
    model = build_model(dict(arch=arch, vocab_size=V, block_size=N, d_model=64, n_heads=4, **FAMILIES[arch]))
    idx = torch.randint(0, V, (4, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref = model(idx, idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, low = model(idx, idx)
    assert torch.isfinite(low)
    assert abs(low.item() - ref.item()) / ref.item() < 0.01, (low.item(), ref.item())
    # and the backward runs under autocast with finite gradients
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name,fn", [("ff1", E.ff1_grad), ("ff2w", E.ff2w_grad)])
def test_fused_ff_gradients_in_bf16_track_float32(name, fn):
    """The fused FF forces under bf16 autocast stay within a few bf16 ulps (relative) of float32."""
    torch.manual_seed(0)
    d, m = 32, 128
    g = torch.randn(2, N, d)
    w1, b1 = torch.randn(m, d) * 0.1, torch.randn(m) * 0.1
    args = (g, w1, b1) if name == "ff1" else (g, w1, b1, torch.randn(d, m) * 0.1, torch.randn(d) * 0.1)
    ref = fn(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = fn(*args)
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel.item()  # bf16 has an 8-bit mantissa (ulp 2⁻⁸ ≈ 4e-3)


def test_float64_model_computes_its_loss_in_float64():
    """A float64 model's loss is float64 and equals the float64 cross-entropy (not a float32 round)."""
    torch.manual_seed(0)
    model = build_model(dict(arch="gpt", vocab_size=V, block_size=N, d_model=32, n_heads=4, n_layers=1)).double()
    idx = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.float64 and loss.dtype == torch.float64
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), idx.reshape(-1))
    assert loss.item() == ref.item()
    # bf16 logits are still promoted to float32
    assert model.lm_loss(logits.to(torch.bfloat16), idx).dtype == torch.float32
