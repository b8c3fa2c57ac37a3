"""Llama baseline parity with transformers, and CEM ≡ a weight-tied Llama at T=1
(docs/baselines.md §3, docs/cem.md §2, §3, docs/testing.md §2).

Models are built from config objects only (HF_HUB_OFFLINE=1; nothing is downloaded).
"""
from __future__ import annotations

import pytest
import torch

from energyformer.models.cem import CEMConfig, CEMLlama
from energyformer.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

V, BLOCK, THETA, EPS = 37, 16, 500.0, 1e-5


def _hf(d_model, n_layers, n_heads, n_kv_heads, d_ff, tie, head_dim=None):
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, max_position_embeddings=BLOCK,
        tie_word_embeddings=tie, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(123)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(seed=0, n=11):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_kv_heads,tie", [(None, False), (2, True), (1, False)])
def test_llama_matches_transformers(n_kv_heads, tie):
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(vocab_size=V, block_size=BLOCK, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                             d_ff=48, rope_theta=THETA, norm_eps=EPS, tie_embeddings=tie)).eval()
    hf = _hf(32, 2, 4, n_kv_heads or 4, 48, tie)
    sd = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in ours.state_dict().items()}
    hf.load_state_dict(sd, strict=not tie)  # tied: HF may or may not list lm_head separately
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mlp_tie", ["gate", "up"])
@pytest.mark.parametrize("head_dim", [None, 6])
def test_cem_one_step_equals_weight_tied_hf_llama(mlp_tie, head_dim):
    """CEM, T=1, η=1, rope='llama', lowrank, no P ≡ HF Llama with v_proj = k_proj, o_proj = q_projᵀ,
    down = gateᵀ (or upᵀ)."""
    torch.manual_seed(0)
    cem = CEMLlama(CEMConfig(vocab_size=V, block_size=BLOCK, d_model=32, n_layers=2, n_heads=4, head_dim=head_dim,
                             d_ff=48, n_steps=1, rope="llama", rope_theta=THETA, interaction="lowrank",
                             mlp_tie=mlp_tie, norm_eps=EPS)).eval()
    with torch.no_grad():  # non-trivial norm weights so that a swapped norm would show
        for n, p in cem.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf = _hf(32, 2, 4, 4, 48, False, head_dim=head_dim)
    sd = {"model.embed_tokens.weight": cem.embed.weight, "model.norm.weight": cem.norm.weight,
          "lm_head.weight": cem.lm_head.weight}
    for i, blk in enumerate(cem.blocks):
        p = f"model.layers.{i}."
        q, k = blk.attn.q_proj.weight, blk.attn.k_proj.weight
        gate, up = blk.mlp.gate_proj.weight, blk.mlp.up_proj.weight
        sd.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": k, p + "self_attn.o_proj.weight": q.t(),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": (gate if mlp_tie == "gate" else up).t(),
            p + "input_layernorm.weight": blk.attn.norm.weight,
            p + "post_attention_layernorm.weight": blk.mlp.norm.weight,
        })
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    idx = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(cem(idx)[0], hf(idx).logits, atol=1e-5, rtol=0)
    # exact RoPE mode is a different model (docs/cem.md §2.1): same weights, other logits
    exact = CEMLlama(CEMConfig.from_dict({**cem.config.to_dict(), "rope": "exact"})).eval()
    exact.load_state_dict(cem.state_dict())
    with torch.no_grad():
        assert (exact(idx)[0] - cem(idx)[0]).abs().max() > 1e-4


def test_llama_causality_with_gqa():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=V, block_size=BLOCK, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                              d_ff=24)).double().eval()
    idx = _ids(2, BLOCK)
    with torch.no_grad():
        logits = model(idx)[0]
        for i in (0, 7, BLOCK - 2):
            changed = idx.clone()
            changed[:, i + 1:] = (changed[:, i + 1:] + 1) % V
            logits2 = model(changed)[0]
            torch.testing.assert_close(logits2[:, : i + 1], logits[:, : i + 1], atol=1e-12, rtol=0)
            assert (logits2[:, i + 1:] - logits[:, i + 1:]).abs().max() > 1e-6


def test_llama_parameter_count_formula():
    """docs/baselines.md §3: 4·d·H·d_h attention + 3·d·d_ff MLP + 2d norms per layer (no GQA, no biases)."""
    d, h, dff, layers = 32, 4, 48, 3
    model = Llama(LlamaConfig(vocab_size=V, d_model=d, n_layers=layers, n_heads=h, d_ff=dff))
    per_layer = 4 * d * d + 3 * d * dff + 2 * d
    assert model.num_params() == layers * per_layer + d + 2 * V * d
    assert model.num_params(non_embedding=True) == layers * per_layer + d + V * d


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    (dict(n_heads=3), "n_heads=3 must divide d_model=16"),
    (dict(head_dim=5), "head_dim=5 must be even"),
    (dict(n_layers=0), "n_layers=0"),
    (dict(rope_theta=-1.0), "rope_theta=-1.0"),
])
def test_llama_config_bad_values_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{"d_model": 16, "n_heads": 4, **kw})
