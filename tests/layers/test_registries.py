"""Every entry of every option registry, built through the public model config, is causal and its
update is the analytic gradient of its energy (autograd in float64). A newly registered entry is
covered by being registered: the parameter lists below are read from the registries at import time.
"""
import pytest
import torch
from helpers import perturb

from energyformer.layers.cem_options import INTERACTIONS, MLP_TIES
from energyformer.layers.norms import NORMS
from energyformer.layers.nrgpt_options import FF_ENERGIES, NRGPT_ATTENTIONS
from energyformer.layers.step_maps import STEP_MAPS, StepMap
from energyformer.models.registry import build_model

V, N, D, H = 13, 9, 16, 2
ATOL = 1e-10
TINY = dict(vocab_size=V, block_size=N, d_model=D, n_heads=H)


def _cem(**kw):
    cfg = dict(arch="cem", n_layers=2, d_ff=24, **TINY)
    cfg.update(kw)
    return perturb(build_model(cfg).double())


def _nrgpt(**kw):
    cfg = dict(arch="nrgpt", n_steps=3, d_ff=24, eta_rank=3, **TINY)
    cfg.update(kw)
    return perturb(build_model(cfg).double())


def _assert_causal(model, n_steps=None):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (2, N), generator=g)
    kw = {} if n_steps is None else {"n_steps": n_steps}
    with torch.no_grad():
        logits, _ = model(idx, **kw)
        for i in (0, 4, N - 2):
            other = idx.clone()
            other[:, i + 1:] = (idx[:, i + 1:] + 1 + torch.randint(0, V - 1, idx[:, i + 1:].shape, generator=g)) % V
            logits2, _ = model(other, **kw)
            torch.testing.assert_close(logits2[:, : i + 1], logits[:, : i + 1], atol=1e-12, rtol=0)
            assert (logits2[:, i + 1:] - logits[:, i + 1:]).abs().max() > 1e-8


def _x(seed=2):
    return torch.randn(2, N, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _autograd(energy_fn, g):
    g = g.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(energy_fn(g).sum(), g)
    return grad


def _check_cem_sub(sub):
    """One CEM sub-block: analytic ∇_g ε = autograd of its energy at g ≠ ĥ, and the step uses it."""
    x, h = _x(2), _x(3)
    with torch.no_grad():
        h_hat, g = sub._normalize(h), sub._normalize(x)
        ctx = sub._context(h_hat)
        analytic = sub._grad(g, h_hat, ctx)
    if sub._energy_or_none(g, h_hat) is not None:
        auto = _autograd(lambda gg: sub._energy_or_none(gg, h_hat.detach()), g)
        torch.testing.assert_close(analytic, auto, atol=ATOL, rtol=0)
    with torch.no_grad():
        p = torch.eye(D, dtype=x.dtype) if sub.preconditioner is None else sub.preconditioner.matrix()
        expected = x - sub.step_size_at(0) * analytic @ p.t()
        torch.testing.assert_close(sub._descend(x, analytic, 0), expected, atol=ATOL, rtol=0)


def _check_nrgpt_block(blk):
    """NRGPT block: force = ∂(E_AT + s_ff E_FF)/∂g with earlier tokens (keys) held fixed; update = x − η·force."""
    x = _x(4)
    blk.eval()
    with torch.no_grad():
        g = blk.normalize(x)
        force = blk.force(x)
    energy = lambda gg: blk.attention.energy(gg, context=g.detach()) + blk.ff_scale * blk.ff.energy(gg)  # noqa: E731
    torch.testing.assert_close(force, _autograd(energy, g), atol=ATOL, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(blk(x), x - force @ blk.eta_matrix().t(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", INTERACTIONS.names())
def test_every_cem_interaction(name):
    rope = "exact" if INTERACTIONS.get(name).has_lowrank else None
    model = _cem(interaction=name, rope=rope, n_steps=2)
    _assert_causal(model)
    for block in model.blocks:
        _check_cem_sub(block.attn)
        assert block.attn.interaction.name == name


@pytest.mark.parametrize("name", MLP_TIES.names())
def test_every_mlp_tie(name):
    model = _cem(mlp_tie=name, n_steps=2)
    _assert_causal(model)
    for block in model.blocks:
        _check_cem_sub(block.mlp)


@pytest.mark.parametrize("name", STEP_MAPS.names())
def test_every_step_map_as_cem_preconditioner(name):
    model = _cem(preconditioner=name, preconditioner_rank=3, n_steps=2, interaction="diag_shared")
    _assert_causal(model)
    for block in model.blocks:
        _check_cem_sub(block.attn)
        _check_cem_sub(block.mlp)


@pytest.mark.parametrize("name", STEP_MAPS.names())
def test_every_step_map_as_nrgpt_eta(name):
    model = _nrgpt(eta_param=name)
    _assert_causal(model)
    _assert_causal(model, n_steps=5)  # more steps than trained
    _check_nrgpt_block(model.block)
    assert model.block.eta.name == name


@pytest.mark.parametrize("name", STEP_MAPS.names())
def test_every_step_map_is_its_matrix(name):
    """forward(v) = v Mᵀ with M = matrix(); the map starts near s·I; a fresh map at s is exactly s·I
    for every map but the ones that document a random part (full, psd_plus_skew)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(D).double()
    m = STEP_MAPS.get(name)(D, 0.3, rank=3, norm=norm).double()
    assert isinstance(m, StepMap)
    v = _x(5)
    torch.testing.assert_close(m(v), v @ m.matrix().t(), atol=ATOL, rtol=0)
    if name not in ("full", "psd_plus_skew"):
        # float32 init
        torch.testing.assert_close(m.matrix(), 0.3 * torch.eye(D, dtype=torch.float64), atol=1e-6, rtol=0)
    else:
        assert (m.matrix() - 0.3 * torch.eye(D, dtype=torch.float64)).abs().max() < 0.5


@pytest.mark.parametrize("name", NRGPT_ATTENTIONS.names())
@pytest.mark.parametrize("mask", ["strict", "inclusive"])
def test_every_nrgpt_attention(name, mask):
    model = _nrgpt(attention=name, mask=mask)
    _assert_causal(model)
    _check_nrgpt_block(model.block)


@pytest.mark.parametrize("name", FF_ENERGIES.names())
def test_every_nrgpt_ff_energy(name):
    model = _nrgpt(ff=name)
    _assert_causal(model)
    _check_nrgpt_block(model.block)


@pytest.mark.parametrize("name", NORMS.names())
def test_every_norm_in_nrgpt(name):
    eta = "c_identity" if name == "none" else "c_diag_gamma"
    model = _nrgpt(norm=name, eta_param=eta)
    _assert_causal(model)
    _check_nrgpt_block(model.block)


def test_unknown_entries_name_the_option_and_the_choices():
    cases = [(dict(arch="cem", interaction="nope"), "interaction='nope'"),
             (dict(arch="cem", mlp_tie="nope"), "mlp_tie='nope'"),
             (dict(arch="cem", preconditioner="nope"), "preconditioner='nope'"),
             (dict(arch="nrgpt", eta_param="nope"), "eta_param='nope'"),
             (dict(arch="nrgpt", attention="nope"), "attention='nope'"),
             (dict(arch="nrgpt", ff="nope"), "ff='nope'"),
             (dict(arch="nrgpt", norm="nope"), "norm='nope'")]
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            build_model({**TINY, **cfg})
        assert "expected one of" in str(err.value)


# ----------------------------------------------------------------------------- gradcheck w.r.t. every parameter
# Forward values and energies can be right while a parameter's gradient is wrong (a `.detach()` of
# γ inside η = c·diag(γ) changes nothing else): every entry's sub-block output (its descent steps)
# and energy are gradchecked in float64 w.r.t. every parameter, at tiny shapes.
GD, GH, GN = 4, 2, 3


class _Probe(torch.nn.Module):
    """``forward(x, h) = fn(sub, x, h)``, so that ``functional_call`` can swap the sub-block's parameters."""

    def __init__(self, sub, fn):
        super().__init__()
        self.sub, self.fn = sub, fn

    def forward(self, x, h):
        return self.fn(self.sub, x, h)


def _gradcheck_every_parameter(sub, fn):
    sub = perturb(sub.double())
    names = [n for n, _ in sub.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in sub.named_parameters())
    assert params, "an entry without parameters has nothing to check"
    x = torch.randn(2, GN, GD, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    h = torch.randn(2, GN, GD, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    probe = _Probe(sub, fn)

    def call(*ps):
        return torch.func.functional_call(probe, {f"sub.{n}": p for n, p in zip(names, ps)}, (x, h))

    assert torch.autograd.gradcheck(call, params, eps=1e-6, atol=1e-6, rtol=1e-4)


def _cem_out_and_energy(sub, x, h):
    out = sub(x)
    e = sub._energy_or_none(sub._normalize(x), sub._normalize(h))
    return out if e is None else (out, e)


def _nrgpt_out_and_energy(blk, x, h):
    e = blk.energy(x)
    return blk(x), e["attn"], e["ff"]


@pytest.mark.parametrize("name", INTERACTIONS.names())
@pytest.mark.parametrize("rope", ["exact", "llama", None])
def test_gradcheck_every_interaction_parameter(name, rope):
    if rope is not None and not INTERACTIONS.get(name).has_lowrank:
        pytest.skip("no low-rank term to rotate")
    from energyformer.layers.cem import CEMAttention

    sub = CEMAttention(GD, GH, n_steps=2, interaction=name, rope=rope, per_step_scale=True)
    _gradcheck_every_parameter(sub, _cem_out_and_energy)


@pytest.mark.parametrize("name", MLP_TIES.names())
def test_gradcheck_every_mlp_tie_parameter(name):
    from energyformer.layers.cem import CEMGatedMLP

    _gradcheck_every_parameter(CEMGatedMLP(GD, 6, n_steps=2, mlp_tie=name), _cem_out_and_energy)


@pytest.mark.parametrize("name", STEP_MAPS.names())
def test_gradcheck_every_step_map_parameter(name):
    from energyformer.layers.cem import CEMGatedMLP
    from energyformer.layers.nrgpt import NRGPTBlock

    _gradcheck_every_parameter(CEMGatedMLP(GD, 6, n_steps=2, preconditioner=name, preconditioner_rank=1),
                               _cem_out_and_energy)
    _gradcheck_every_parameter(NRGPTBlock(GD, GH, d_ff=6, eta_param=name, eta_rank=1, c_init=0.3),
                               _nrgpt_out_and_energy)


@pytest.mark.parametrize("attention", NRGPT_ATTENTIONS.names())
@pytest.mark.parametrize("ff", FF_ENERGIES.names())
def test_gradcheck_every_nrgpt_attention_and_ff_parameter(attention, ff):
    from energyformer.layers.nrgpt import NRGPTBlock

    blk = NRGPTBlock(GD, GH, attention=attention, ff=ff, d_ff=6, mask="inclusive")
    _gradcheck_every_parameter(blk, _nrgpt_out_and_energy)


@pytest.mark.parametrize("name", NORMS.names())
def test_gradcheck_every_norm_parameter(name):
    from energyformer.layers.nrgpt import NRGPTBlock

    eta = "c_identity" if name == "none" else "c_diag_gamma"
    _gradcheck_every_parameter(NRGPTBlock(GD, GH, d_ff=6, norm=name, eta_param=eta), _nrgpt_out_and_energy)
