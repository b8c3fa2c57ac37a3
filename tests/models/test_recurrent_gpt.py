"""GPT_Rec / GPT_Rec_parallel (docs/baselines.md §3) and the baseline parameter counts of
docs/nrgpt.md §9 / docs/testing.md §10."""
import pytest
import torch
import torch.nn.functional as F

from energyformer import build_model
from energyformer.models.gpt import GPT, GPTConfig
from energyformer.models.recurrent_gpt import RecurrentGPT, RecurrentGPTConfig

V, BLOCK = 13, 16




def tiny(parallel, **kw):
    torch.manual_seed(0)
    cfg = RecurrentGPTConfig(d_model=16, n_heads=2, n_steps=3, vocab_size=V, block_size=BLOCK, parallel=parallel, **kw)
    model = RecurrentGPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def plain_forward(model, idx, T):
    """Reference written out: shared block applied T times, sequential or parallel form."""
    blk = model.block
    x = model.wte.weight[idx] + model.wpe.weight[: idx.shape[1]]

    def attn(h):
        B, N, d = h.shape
        q, k, v = (h @ blk.attn.qkv_proj.weight.T).split(d, dim=-1)
        q, k, v = (t.view(B, N, 2, d // 2).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / (d // 2) ** 0.5
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, N, d)
        return y @ blk.attn.o_proj.weight.T + blk.attn.o_proj.bias

    def mlp(h):
        act = F.relu if model.config.activation == "relu" else F.gelu
        up = act(h @ blk.mlp.up_proj.weight.T + blk.mlp.up_proj.bias)
        return up @ blk.mlp.down_proj.weight.T + blk.mlp.down_proj.bias

    ln = lambda h, m: F.layer_norm(h, (h.shape[-1],), m.weight, m.bias)  # noqa: E731
    for _ in range(T):
        if model.config.parallel:
            x = x + attn(ln(x, blk.ln_1)) + mlp(ln(x, blk.ln_2))
        else:
            x = x + attn(ln(x, blk.ln_1))
            x = x + mlp(ln(x, blk.ln_2))
    return ln(x, model.ln_f) @ model.lm_head.weight.T + model.lm_head.bias


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_plain_loop_and_n_steps(parallel, activation):
    model = tiny(parallel, activation=activation)
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for T in (None, 1, 5):
            logits, _ = model(idx, n_steps=T)
            torch.testing.assert_close(logits, plain_forward(model, idx, T or 3), atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="n_steps"):
        model(idx, n_steps=0)


@pytest.mark.parametrize("parallel", [False, True])
def test_causal_every_step_count(parallel):
    model = tiny(parallel)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (2, 12), generator=gen)
    idx2 = idx.clone()
    idx2[:, 6:] = torch.randint(0, V, (2, 6), generator=gen)
    with torch.no_grad():
        for T in (1, 3, 6):
            a, b = model(idx, n_steps=T)[0], model(idx2, n_steps=T)[0]
            torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-12, rtol=0)
            assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_one_shared_block_and_generate():
    model = tiny(True)
    assert len([m for m in model.modules() if m.__class__.__name__ == "GPTBlock"]) == 1
    deep = RecurrentGPT(RecurrentGPTConfig(d_model=16, n_heads=2, n_steps=9, vocab_size=V, block_size=BLOCK,
                                           parallel=True))
    assert deep.num_params() == model.num_params()  # depth adds no parameters
    idx = torch.randint(0, V, (2, 3))
    out = model.generate(idx, max_new_tokens=5, temperature=0.0, n_steps=2)
    ref = idx
    with torch.no_grad():
        for _ in range(5):
            ref = torch.cat([ref, model(ref, n_steps=2)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw, match", [(dict(n_steps=0), "n_steps"), (dict(d_model=10, n_heads=4), "n_heads"),
                                       (dict(activation="silu"), "activation"), (dict(parallel="yes"), "parallel")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        RecurrentGPTConfig(**kw)


def test_config_round_trip_and_build():
    cfg = RecurrentGPTConfig(parallel=True)
    assert RecurrentGPTConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(build_model({"arch": "gpt_rec", "d_model": 16, "n_heads": 2}), RecurrentGPT)


OWT = dict(d_model=768, n_heads=12, vocab_size=50304, block_size=1024)


def test_parameter_counts_spec():
    """docs/nrgpt.md §9 / docs/testing.md §10, built on the meta device."""
    with torch.device("meta"):
        rec_par = RecurrentGPT(RecurrentGPTConfig(**OWT, n_steps=12, parallel=True))
        rec_seq = RecurrentGPT(RecurrentGPTConfig(**OWT, n_steps=12, parallel=False))
        gpt = GPT(GPTConfig(**OWT, n_layers=12))
        gpt_tied = GPT(GPTConfig(**OWT, n_layers=12, tie_embeddings=True))
    assert rec_par.num_params() == 85_190_784
    assert rec_seq.num_params() == 85_190_784  # same parameters, different wiring
    assert gpt.num_params() == 163_132_032
    assert gpt_tied.num_params() == 124_448_256
