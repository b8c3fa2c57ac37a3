"""NRGPTRecurrent, the multi-step NRGPT as a layer (layers/nrgpt_recurrent.py): the NRGPT model is
that layer plus embeddings and a head (same descent, same weight names), and the layer alone is
causal, scales its steps at call time, stops tokens early, traces and decodes with a cache."""
import pytest
import torch

from energyformer import NRGPT, NRGPTBlock, NRGPTConfig, NRGPTRecurrent, tracing
from energyformer.layers.kv_cache import KVCache

D, H = 16, 2


def _layer(**kw):
    torch.manual_seed(0)
    return NRGPTRecurrent(D, H, n_steps=kw.pop("n_steps", 3), d_ff=2 * D, **kw).double().eval()


def _x(n=10, seed=1):
    return torch.randn(2, n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_model_is_the_layer_with_embeddings_and_a_head():
    torch.manual_seed(0)
    model = NRGPT(NRGPTConfig(vocab_size=13, block_size=16, d_model=D, n_heads=H, n_steps=3,
                              per_step_scale=True)).double().eval()
    assert isinstance(model, NRGPTRecurrent)
    names = set(model.state_dict())
    assert {"block.attention.J", "step_scales", "wte.weight", "lm_head.bias"} <= names
    assert not any(n.startswith(("recurrence.", "nrgpt.")) for n in names)
    idx = torch.randint(0, 13, (2, 9))
    x = NRGPTRecurrent.descend(model, model.embed(idx), n_steps=5, stop_tol=1e-4)
    logits, _ = model(idx, n_steps=5, stop_tol=1e-4)
    torch.testing.assert_close(logits, model.lm_head(model.ln_f(x)), rtol=0, atol=0)


def test_the_layer_is_n_steps_applications_of_its_block():
    layer = _layer(per_step_scale=True)
    with torch.no_grad():
        layer.step_scales.copy_(torch.tensor([0.5, 1.0, 1.5]))
    x = _x()
    want = x
    for t in range(4):  # the 4th step reuses the last κ
        want = layer.block(want, layer.step_scales[min(t, 2)])
    torch.testing.assert_close(layer(x, n_steps=4), want)
    assert layer(x).shape == x.shape


def test_a_given_block_is_used_as_it_is():
    block = NRGPTBlock(D, H, attention="factored")
    layer = NRGPTRecurrent(block=block, n_steps=2)
    assert layer.block is block and layer.step_scales is None
    with pytest.raises(ValueError, match="takes no d_model"):
        NRGPTRecurrent(D, H, block=block)
    with pytest.raises(ValueError, match="needs d_model and n_heads"):
        NRGPTRecurrent(n_steps=2)
    with pytest.raises(ValueError, match="n_steps=0 must be >= 1"):
        NRGPTRecurrent(D, H, n_steps=0)


def test_the_layer_is_causal_with_early_stopping():
    layer = _layer(n_steps=6)
    x, y = _x(seed=1), _x(seed=2)
    y[:, :6] = x[:, :6]
    with torch.no_grad():
        a, b = layer(x, stop_tol=1e-3), layer(y, stop_tol=1e-3)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_tracing_the_layer_records_every_state_and_the_steps_taken():
    layer = _layer(n_steps=4)
    with torch.no_grad(), tracing(layer) as trace:
        out = layer(_x(), stop_tol=0.0)  # stop_tol 0 never freezes a token: every token takes 4 steps
    assert trace.terms(layer=0) == ["attn", "ff", "total"]
    assert trace.energy("total", layer=0).shape == (5, 2, 10)
    assert torch.equal(trace.steps_taken, torch.full((2, 10), 4))
    torch.testing.assert_close(trace.states(layer=0)[-1], out)


@pytest.mark.parametrize("stop_tol", [None, 1e-3])
def test_cached_decoding_of_the_layer_equals_the_whole_sequence(stop_tol):
    layer, x = _layer(n_steps=3), _x(n=8)
    with torch.no_grad():
        whole = layer(x, stop_tol=stop_tol)
        cache = KVCache()
        parts = [layer(x[:, :5], stop_tol=stop_tol, cache=cache)]
        parts += [layer(x[:, i:i + 1], stop_tol=stop_tol, cache=cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole)
