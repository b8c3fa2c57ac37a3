"""Weights between our models and stock ``transformers`` Llama / GPT-2 (docs/baselines.md §3, docs/cem.md §2).

- :func:`to_llama`: our Llama (names equal up to the ``model.`` prefix), and CEM-Llama where it
  *is* a Llama: T = 1 in both sub-blocks, ``rope="llama"``, ``interaction="lowrank"``, no
  preconditioner, ``grad_through_norm=false`` (docs/cem.md §2: one descent step is Llama
  attention with ``v_proj = k_proj`` and ``o_proj = η·q_projᵀ``, and SwiGLU with
  ``down_proj = η·gate_projᵀ``, or ``η·up_projᵀ`` for ``mlp_tie="up"``). The tied matrices are
  written out, the learned step size η folded in.
- :func:`to_gpt2`: our GPT. GPT-2's ``Conv1D`` stores ``(in, out)``, so matrices are transposed;
  our bias-free query/key/value projection gets a zero bias. Activations map exactly
  (``relu`` → ``"relu"``, ``gelu`` (erf) → ``"gelu"``). An LM-head bias ``b`` has no GPT-2 slot;
  it is folded into the final LayerNorm's bias (:func:`fold_head_bias`) when the head matrix
  has full row rank (``vocab_size ≤ d_model``: a character vocabulary), else refused.
- :func:`from_llama` / :func:`from_gpt2`: the reverse, for ``energyformer import-hf``.

Every function raises ``ValueError`` naming the option that cannot be represented.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, LlamaConfig

from energyformer.models.base import CausalLM
from energyformer.models.cem import CEMConfig
from energyformer.models.gpt import GPTConfig
from energyformer.models.llama import LlamaConfig as OurLlamaConfig
from energyformer.models.registry import ARCH_SPECS, get_spec

GPT2_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}  # ours -> transformers ACT2FN name (both exact)


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}


def llama_blockers(config: Any) -> list[str]:
    """Why a model config cannot be written as a stock Llama (empty: it can): its arch's
    :class:`~energyformer.models.registry.ArchSpec` has another ``hf_family``, or a CEM config
    that is not a Llama (T ≠ 1, another interaction, ...), or a plugin's config that declares the
    family without being a :class:`energyformer.models.llama.LlamaConfig` (the export reads that
    class's fields and its model's parameter names)."""
    if get_spec(config.arch).hf_family != "llama":
        families = " and ".join(a for a, s in ARCH_SPECS.items() if s.hf_family == "llama")
        return [f"arch={config.arch!r} (only {families} export as a Llama)"]
    if isinstance(config, OurLlamaConfig):
        return []
    if not isinstance(config, CEMConfig):
        return [f"arch={config.arch!r} declares hf_family='llama' but its config "
                f"{type(config).__name__} is not a subclass of energyformer.models.llama.LlamaConfig"]
    c: CEMConfig = config
    want = {"attn_n_steps": 1, "mlp_n_steps": 1, "rope": "llama", "interaction": "lowrank",
            "preconditioner": None, "grad_through_norm": False}
    return [f"{k}={getattr(c, k)!r} (needs {v!r})" for k, v in want.items()
            if getattr(c, k) != v]


def to_llama(model: CausalLM) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(transformers.LlamaConfig, state dict of LlamaForCausalLM)`` equal to ``model``.

    Raises:
        ValueError: the model is not a Llama or a CEM that equals one (the options are named).
    """
    c = model.config
    blockers = llama_blockers(c)
    if blockers:
        raise ValueError("this model cannot be exported as a stock Llama: " + ", ".join(blockers)
                         + " (docs/cem.md §2)")
    is_cem = isinstance(c, CEMConfig)
    n_kv = c.n_heads if is_cem else c.n_kv_heads
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=n_kv,
        head_dim=c.head_dim, rms_norm_eps=c.norm_eps, max_position_embeddings=c.block_size,
        tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        use_cache=False, **_rope(c.rope_theta))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not is_cem:
        out = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in sd.items()}
    else:
        out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"],
               "lm_head.weight": sd["lm_head.weight"]}
        for i, blk in enumerate(model.blocks):
            p = f"model.layers.{i}."
            with torch.no_grad():
                q, k = blk.attn.q_proj.weight.detach(), blk.attn.k_proj.weight.detach()
                gate, up = blk.mlp.gate_proj.weight.detach(), blk.mlp.up_proj.weight.detach()
                tied = gate if c.mlp_tie == "gate" else up
                out.update({
                    p + "self_attn.q_proj.weight": q.clone(), p + "self_attn.k_proj.weight": k.clone(),
                    p + "self_attn.v_proj.weight": k.clone(),
                    p + "self_attn.o_proj.weight": blk.attn.step_size_at(0) * q.t(),
                    p + "mlp.gate_proj.weight": gate.clone(), p + "mlp.up_proj.weight": up.clone(),
                    p + "mlp.down_proj.weight": blk.mlp.step_size_at(0) * tied.t(),
                    p + "input_layernorm.weight": blk.attn.norm.weight.detach().clone(),
                    p + "post_attention_layernorm.weight": blk.mlp.norm.weight.detach().clone(),
                })
    if c.tie_embeddings:
        out.pop("lm_head.weight", None)
    return hf_config, {k: v.contiguous() for k, v in out.items()}


def to_gpt2(model: CausalLM) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """``(transformers.GPT2Config, state dict of GPT2LMHeadModel)`` equal to our GPT ``model``.

    Raises:
        ValueError: not arch ``gpt`` (or a plugin arch of family ``gpt2`` whose config is a
            :class:`~energyformer.models.gpt.GPTConfig`), or an LM-head bias that is not zero (GPT-2's head has none;
            train with ``tie_embeddings: true`` or ``bias: false`` to export).
    """
    c: GPTConfig = model.config
    if get_spec(c.arch).hf_family != "gpt2":
        families = " or ".join(repr(a) for a, s in ARCH_SPECS.items() if s.hf_family == "gpt2")
        raise ValueError(f"arch={c.arch!r} cannot be exported as GPT-2; only arch {families} can")
    if not isinstance(c, GPTConfig):
        raise ValueError(f"arch={c.arch!r} declares hf_family='gpt2' but its config {type(c).__name__} is not a "
                         "subclass of energyformer.models.gpt.GPTConfig (the export reads its fields and its "
                         "model's parameter names)")
    head_bias = getattr(model.lm_head, "bias", None)
    ln_f_bias = model.ln_f.bias.detach() if model.ln_f.bias is not None else torch.zeros(c.d_model)
    if head_bias is not None and bool(head_bias.detach().abs().max() > 0):
        ln_f_bias = fold_head_bias(model.lm_head.weight.detach(), head_bias.detach(), ln_f_bias)
    hf_config = GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads,
        n_inner=c.d_ff, activation_function=GPT2_ACTIVATIONS[c.activation], resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, layer_norm_epsilon=model.ln_f.eps, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=None, eos_token_id=None, use_cache=False)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    d = c.d_model

    def bias(name: str, n: int) -> torch.Tensor:
        return sd[name].clone() if name in sd else torch.zeros(n, dtype=sd["wte.weight"].dtype)

    out = {"transformer.wte.weight": sd["wte.weight"].clone(), "transformer.wpe.weight": sd["wpe.weight"].clone(),
           "transformer.ln_f.weight": sd["ln_f.weight"].clone(),
           "transformer.ln_f.bias": ln_f_bias.to(sd["wte.weight"].dtype).clone()}
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"].clone()
    for i in range(c.n_layers):
        s, p = f"blocks.{i}.", f"transformer.h.{i}."
        out.update({
            p + "ln_1.weight": sd[s + "ln_1.weight"].clone(), p + "ln_1.bias": bias(s + "ln_1.bias", d),
            p + "ln_2.weight": sd[s + "ln_2.weight"].clone(), p + "ln_2.bias": bias(s + "ln_2.bias", d),
            p + "attn.c_attn.weight": sd[s + "attn.qkv_proj.weight"].t().clone(),
            p + "attn.c_attn.bias": bias(s + "attn.qkv_proj.bias", 3 * d),
            p + "attn.c_proj.weight": sd[s + "attn.o_proj.weight"].t().clone(),
            p + "attn.c_proj.bias": bias(s + "attn.o_proj.bias", d),
            p + "mlp.c_fc.weight": sd[s + "mlp.up_proj.weight"].t().clone(),
            p + "mlp.c_fc.bias": bias(s + "mlp.up_proj.bias", c.d_ff),
            p + "mlp.c_proj.weight": sd[s + "mlp.down_proj.weight"].t().clone(),
            p + "mlp.c_proj.bias": bias(s + "mlp.down_proj.bias", d),
        })
    return hf_config, {k: v.contiguous() for k, v in out.items()}


def fold_head_bias(weight: torch.Tensor, head_bias: torch.Tensor, ln_bias: torch.Tensor) -> torch.Tensor:
    """The final LayerNorm bias ``β'`` with ``W·β' = W·β + b``: logits ``W·(g⊙x̂ + β) + b`` without a head bias.

    ``weight`` ``(V, d)``, ``head_bias`` ``(V,)``, ``ln_bias`` ``(d,)``; solved in float64 (least
    squares), exact when ``W`` has full row rank.

    Raises:
        ValueError: ``b`` is not in the range of ``W`` (``vocab_size > d_model``, or a rank-deficient
            head): the residual is named.
    """
    w, b = weight.double(), head_bias.double()
    delta = torch.linalg.lstsq(w, b.unsqueeze(1)).solution.squeeze(1)
    residual = float((w @ delta - b).abs().max())
    if residual > 1e-6 * max(1.0, float(b.abs().max())):
        raise ValueError(f"the LM head has a bias (bias=true, tie_embeddings=false) that GPT2LMHeadModel cannot "
                         f"hold: it cannot be folded into the final LayerNorm (vocab_size={weight.shape[0]} > "
                         f"d_model={weight.shape[1]}, residual {residual:.2e}); export with --as energyformer, or "
                         "train with tie_embeddings: true or bias: false")
    return (ln_bias.double() + delta).to(ln_bias.dtype)


def from_llama(hf_config: LlamaConfig,
               state: dict[str, torch.Tensor]) -> tuple[OurLlamaConfig, dict[str, torch.Tensor]]:
    """Our Llama config and state dict from a stock ``LlamaForCausalLM``'s.

    Raises:
        ValueError: options our Llama does not have (biases, an activation other than SiLU, RoPE
            scaling), each named.
    """
    h = hf_config
    rope = dict(getattr(h, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(h, "rope_theta", 10000.0))
    problems = []
    if getattr(h, "attention_bias", False) or getattr(h, "mlp_bias", False):
        problems.append("attention_bias/mlp_bias=true (our Llama has no biases)")
    if getattr(h, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={h.hidden_act!r} (ours is 'silu')")
    rope_type = (rope or getattr(h, "rope_scaling", None) or {}).get("rope_type", "default")  # v5 / v4 names
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (ours is 'default', no scaling)")
    if problems:
        raise ValueError("this Llama cannot be imported exactly: " + "; ".join(problems))
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    ours = OurLlamaConfig(vocab_size=h.vocab_size, block_size=h.max_position_embeddings, d_model=h.hidden_size,
                          n_layers=h.num_hidden_layers, n_heads=h.num_attention_heads,
                          n_kv_heads=h.num_key_value_heads, head_dim=head_dim, d_ff=h.intermediate_size,
                          norm_eps=h.rms_norm_eps, tie_embeddings=bool(h.tie_word_embeddings), rope_theta=float(theta))
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()
          if not k.endswith("rotary_emb.inv_freq")}
    if ours.tie_embeddings:  # our state dict names the tied head too
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    return ours, sd


def from_gpt2(hf_config: GPT2Config, state: dict[str, torch.Tensor]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our GPT config and state dict from a stock ``GPT2LMHeadModel``'s.

    GPT-2's query/key/value bias has no slot in our GPT (its projection has no bias), so it must
    be zero; the other biases map one to one.

    Raises:
        ValueError: an activation without an exact match (GPT-2's own ``gelu_new`` is the tanh
            approximation; ours are ``relu`` and erf ``gelu``), a non-zero ``c_attn`` bias, or
            options our GPT lacks (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``).
    """
    h = hf_config
    acts = {v: k for k, v in GPT2_ACTIVATIONS.items()}
    if h.activation_function not in acts:
        raise ValueError(f"activation_function={h.activation_function!r} has no exact match in our GPT "
                         f"(it has {sorted(acts)}: relu and the erf GELU); GPT-2's 'gelu_new' is the tanh "
                         "approximation")
    if getattr(h, "scale_attn_by_inverse_layer_idx", False) or getattr(h, "reorder_and_upcast_attn", False):
        raise ValueError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not options of our GPT")
    sd = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in state.items()}
    n_inner = h.n_inner or 4 * h.n_embd
    ours = GPTConfig(vocab_size=h.vocab_size, block_size=h.n_positions, d_model=h.n_embd, n_layers=h.n_layer,
                     n_heads=h.n_head, d_ff=n_inner, activation=acts[h.activation_function], bias=True,
                     tie_embeddings=bool(h.tie_word_embeddings))
    out = {"wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"], "ln_f.weight": sd["ln_f.weight"],
           "ln_f.bias": sd["ln_f.bias"]}
    if ours.tie_embeddings:  # our state dict names the tied head too
        out["lm_head.weight"] = sd["wte.weight"]
    else:
        out["lm_head.weight"] = sd["lm_head.weight"]
        out["lm_head.bias"] = torch.zeros(h.vocab_size, dtype=sd["wte.weight"].dtype)
    for i in range(h.n_layer):
        p, s = f"h.{i}.", f"blocks.{i}."
        if bool(sd[p + "attn.c_attn.bias"].abs().max() > 0):
            raise ValueError(f"layer {i}: GPT-2's c_attn bias is not zero and our GPT's query/key/value "
                             "projection has no bias")
        out.update({
            s + "ln_1.weight": sd[p + "ln_1.weight"], s + "ln_1.bias": sd[p + "ln_1.bias"],
            s + "ln_2.weight": sd[p + "ln_2.weight"], s + "ln_2.bias": sd[p + "ln_2.bias"],
            s + "attn.qkv_proj.weight": sd[p + "attn.c_attn.weight"].t(),
            s + "attn.o_proj.weight": sd[p + "attn.c_proj.weight"].t(),
            s + "attn.o_proj.bias": sd[p + "attn.c_proj.bias"],
            s + "mlp.up_proj.weight": sd[p + "mlp.c_fc.weight"].t(), s + "mlp.up_proj.bias": sd[p + "mlp.c_fc.bias"],
            s + "mlp.down_proj.weight": sd[p + "mlp.c_proj.weight"].t(),
            s + "mlp.down_proj.bias": sd[p + "mlp.c_proj.bias"],
        })
    return ours, {k: v.contiguous().clone() for k, v in out.items()}
