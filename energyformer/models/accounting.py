"""Parameter accounting: CEM vs the matching Llama baseline (docs/cem.md §8).

Models are built on the ``meta`` device (no memory, no init cost) and counted from their
actual parameters (shared tensors once), so the numbers are what training would use.

Each arch's :class:`~energyformer.models.registry.ArchSpec` names its view (``accounting``). For
``"vs_llama"`` (CEM) the per-layer counts are split into the groups each sub-block reports through
its ``param_groups()`` (each option entry names its own parameters' groups): projections, the
D+LR diagonal, the preconditioner, step sizes and the norm, next to a Llama with the same
``d_model``, ``n_layers``, ``n_heads``, ``head_dim``, ``d_ff``, vocabulary and embedding tie
(docs/cem.md §8)::

    Llama = 4 d·H d_h + 3 d d_ff + 2d
    CEM   = 2 d·H d_h + 2 d d_ff + 2d + [D+LR: H d or d] + [P: 2·(d + 2 d r)] + [η: 2]

For ``"layers"`` (Llama) the same split is given for the model alone; ``"totals"`` (any other
arch) gives totals only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from energyformer.models.config import ModelConfig
from energyformer.models.registry import get_arch, get_spec

__all__ = ["parameter_counts", "parameter_report"]


def _build_meta(cfg: ModelConfig) -> nn.Module:
    model_cls, _ = get_arch(cfg.arch)
    with torch.device("meta"):
        return model_cls(cfg)


def _count(params) -> int:
    seen, n = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def _groups(sub: nn.Module) -> dict[str, int]:
    """Counts per accounting group of a sub-block, in the order its ``param_groups()`` reports them
    (the groups come from the option entries), then ``total``."""
    d = {name: _count(params) for name, params in sub.param_groups().items()}
    d["total"] = _count(sub.parameters())
    return d


def _llama_layer(layer: nn.Module) -> dict[str, dict[str, int]]:
    attn = {"projections": _count(layer.self_attn.parameters()), "norm": _count(layer.input_layernorm.parameters())}
    attn["total"] = attn["projections"] + attn["norm"]
    mlp = {"projections": _count(layer.mlp.parameters()), "norm": _count(layer.post_attention_layernorm.parameters())}
    mlp["total"] = mlp["projections"] + mlp["norm"]
    return {"attn": attn, "mlp": mlp, "total": _count(layer.parameters())}


def _totals(model: nn.Module, cfg: ModelConfig) -> dict[str, Any]:
    total = model.num_params() if hasattr(model, "num_params") else _count(model.parameters())
    non_emb = model.num_params(non_embedding=True) if hasattr(model, "num_params") else total
    return {"arch": cfg.arch, "total": total, "non_embedding": non_emb, "embedding": total - non_emb}


def _llama_baseline_config(cfg: ModelConfig) -> ModelConfig | None:
    """The Llama that matches a CEM config (same widths, heads, layers, vocab, tie)."""
    _, llama_cfg_cls = get_arch("llama")
    try:
        return llama_cfg_cls(vocab_size=cfg.vocab_size, block_size=cfg.block_size, d_model=cfg.d_model,
                             n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
                             d_ff=cfg.d_ff, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                             tie_embeddings=cfg.tie_embeddings)
    except ValueError:  # e.g. an odd head_dim (fine for CEM without RoPE, not for Llama)
        return None


def parameter_counts(cfg: ModelConfig) -> dict[str, Any]:
    """Parameter numbers for any registered arch's config, as a dict.

    Always: ``arch``, ``total``, ``non_embedding``, ``embedding`` (token/position tables).
    The ``"vs_llama"`` view (CEM): ``per_layer`` = ``{"attn": {...}, "mlp": {...}, "total"}`` where each sub-block dict
    has the counts of the groups its ``param_groups()`` reports (from its option entries: e.g.
    ``projections``, ``diag`` (the interaction), ``preconditioner``, ``step_size``, ``norm``), and ``total``;
    ``baseline`` = the matching Llama's counts (same layout; None if no Llama matches);
    ``ratios`` = CEM/Llama for ``attn_projections``, ``mlp_projections``, ``layer``,
    ``non_embedding``, ``total``. The ``"layers"`` view (Llama): ``per_layer`` in the same layout.

    Raises:
        ValueError: unregistered arch.
    """
    model = _build_meta(cfg)
    out = _totals(model, cfg)
    out["n_layers"] = getattr(cfg, "n_layers", None)
    out["n_steps"] = getattr(cfg, "n_steps", None)
    view = get_spec(cfg.arch).accounting
    if view == "vs_llama":
        block = model.blocks[0]
        attn, mlp = _groups(block.attn), _groups(block.mlp)
        out["per_layer"] = {"attn": attn, "mlp": mlp, "total": _count(block.parameters())}
        base_cfg = _llama_baseline_config(cfg)
        if base_cfg is None:
            out["baseline"], out["ratios"] = None, None
            return out
        base = parameter_counts(base_cfg)
        out["baseline"] = base
        bl = base["per_layer"]
        out["ratios"] = {
            "attn_projections": attn["projections"] / bl["attn"]["projections"],
            "mlp_projections": mlp["projections"] / bl["mlp"]["projections"],
            "layer": out["per_layer"]["total"] / bl["total"],
            "non_embedding": out["non_embedding"] / base["non_embedding"],
            "total": out["total"] / base["total"],
        }
    elif view == "layers":
        out["per_layer"] = _llama_layer(model.layers[0])
    return out


def _fmt(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def parameter_report(cfg: ModelConfig) -> str:
    """A readable table of :func:`parameter_counts` (CEM next to its Llama baseline; totals for other archs)."""
    c = parameter_counts(cfg)
    depth = (f"n_layers={c['n_layers']}" if c["n_layers"] is not None
             else f"n_steps={c.get('n_steps')} (one shared block)")
    lines = [f"model arch={c['arch']!r}  {depth}"]
    if c.get("baseline") is not None:
        pl, bl = c["per_layer"], c["baseline"]["per_layer"]
        lines[0] += (f"  vs Llama (d_model={cfg.d_model}, n_heads={cfg.n_heads}, "
                     f"head_dim={cfg.head_dim}, d_ff={cfg.d_ff})")
        rows = [(f"per layer: {label} {group.replace('_', ' ')}", n, bl[sub].get(group, 0))
                for sub, label in (("attn", "attention"), ("mlp", "MLP"))
                for group, n in pl[sub].items() if group != "total"]
        rows += [("per layer: total", pl["total"], bl["total"]),
                 ("embedding", c["embedding"], c["baseline"]["embedding"]),
                 ("non-embedding", c["non_embedding"], c["baseline"]["non_embedding"]),
                 ("total", c["total"], c["baseline"]["total"])]
        w = max(len(r[0]) for r in rows)
        lines.append(f"{'':<{w}}  {'cem':>12}  {'llama':>12}  {'ratio':>6}")
        for name, a, b in rows:
            ratio = f"{a / b:6.3f}" if b else "     -"
            lines.append(f"{name:<{w}}  {_fmt(a):>12}  {_fmt(b):>12}  {ratio}")
        return "\n".join(lines)
    rows = []
    if "per_layer" in c:
        pl = c["per_layer"]
        rows += [("per layer: attention", pl["attn"]["total"]), ("per layer: MLP", pl["mlp"]["total"]),
                 ("per layer: total", pl["total"])]
    rows += [("embedding", c["embedding"]), ("non-embedding", c["non_embedding"]), ("total", c["total"])]
    w = max(len(r[0]) for r in rows)
    lines += [f"{name:<{w}}  {_fmt(n):>12}" for name, n in rows]
    return "\n".join(lines)
