"""Energy trajectories of a trained energy model (NRGPT, CEM with ``rope`` exact or None).

Built on the one trace type (:class:`~energyformer.layers.trace.Trace`): a forward under
``with model.trace() as trace:`` records, per layer and sub-block (CEM: ``attn``/``mlp`` of each
layer; NRGPT: the one shared ``block``), every state ``x⁰ … x^S`` with its per-token energy terms
and the gradient ``∇E`` each step used. From it :func:`energy_report` derives, per step ``t`` and
token::

    energy[term][t]      E_term(x^t)                       (S + 1 values)
    grad_norm[t]         ‖∇E(x^t)‖                         (S values: the steps taken)
    step_norm[t]         ‖Δx^t‖ = ‖x^{t+1} − x^t‖          (S values)
    cos[t]               cos(Δx^t, −∇E(x^t))               (S values; 1 = a pure gradient step)

The gradient is the one the layer used (w.r.t. the normalized state ``g``, before the step
map / preconditioner), so ``cos < 1`` shows the step map at work (NRGPT's η, CEM's P).

    energyformer inspect out/nrgpt --prompt "ROMEO:" --out figs/nrgpt
    → figs/nrgpt/trace.json, energy_steps.png, energy_heatmap.png
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from energyformer.layers.trace import Trace


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-30)


def report_from_trace(trace: Trace, batch_index: int = 0) -> list[dict[str, Any]]:
    """One entry per (layer, sub-block) of ``trace``, for sequence ``batch_index`` of the batch.

    Each entry: ``layer``, ``sub``, ``steps`` (S), ``energy`` ({term: (S + 1) × N nested lists}),
    ``grad_norm``, ``step_norm``, ``cos`` (S × N each) and ``state_norm`` ((S + 1) × N).

    Raises:
        ValueError: the trace holds no energies (e.g. CEM attention with ``rope="llama"``, which is
            not the gradient of an energy).
    """
    out = []
    for layer in trace.layers():
        for sub in trace.subs(layer):
            recs = trace.select(layer, sub)
            if not any(r.energies for r in recs):
                raise ValueError(f"layer {layer}, sub-block {sub!r} recorded no energy (CEM attention with "
                                 "rope='llama' has none; use rope='exact' or None)")
            xs = [r.x[batch_index].double() for r in recs]
            deltas = [b - a for a, b in zip(xs[:-1], xs[1:])]
            grads = [r.grad[batch_index].double() for r in recs[:-1]]
            out.append({
                "layer": layer, "sub": sub, "steps": len(recs) - 1,
                "energy": {term: [r.energies[term][batch_index].tolist() for r in recs] for term in recs[0].energies},
                "state_norm": [r.state_norm[batch_index].tolist() for r in recs],
                "grad_norm": [g.norm(dim=-1).tolist() for g in grads],
                "step_norm": [d.norm(dim=-1).tolist() for d in deltas],
                "cos": [_cos(d, -g).tolist() for d, g in zip(deltas, grads)],
            })
    return out


@torch.no_grad()
def energy_report(model: torch.nn.Module, idx: torch.Tensor, **forward_kwargs: Any) -> dict[str, Any]:
    """Run ``model`` on ``idx`` ``(1, N)`` under tracing and return the report of its first sequence.

    ``forward_kwargs`` go to the forward (NRGPT: ``n_steps``, ``stop_tol``).

    Returns:
        ``{"blocks": report_from_trace(...), "steps_taken": (N,) list or None}``.

    Raises:
        ValueError: the model has no energies (GPT, Llama, recurrent GPT), or see :func:`report_from_trace`.
    """
    was_training = model.training
    model.eval()
    try:
        with model.trace() as trace:
            model(idx, **forward_kwargs)
    finally:
        model.train(was_training)
    steps = None if trace.steps_taken is None else trace.steps_taken[0].tolist()
    return {"blocks": report_from_trace(trace), "steps_taken": steps}


def plot_report(report: dict[str, Any], tokens: Sequence[str], out_dir: str | Path) -> list[Path]:
    """``energy_steps.png`` (energy vs step, one line per token, a panel per block and term) and
    ``energy_heatmap.png`` (token × step heat map of each term's energy minus its value at step 0).

    Returns:
        the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = [(b, term) for b in report["blocks"] for term in b["energy"]]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, (b, term) in zip(axes.flat, panels):
        e = torch.tensor(b["energy"][term])  # (S + 1, N)
        for j in range(e.shape[1]):
            ax.plot(range(e.shape[0]), e[:, j], color=cmap(j / max(1, e.shape[1] - 1)), alpha=0.8, linewidth=1)
        ax.set_title(f"layer {b['layer']} {b['sub']}: {term}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("energy per token")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("energy vs step (one line per token; dark = early tokens)", fontsize=10)
    fig.tight_layout()
    steps_png = out_dir / "energy_steps.png"
    fig.savefig(steps_png, dpi=110)
    plt.close(fig)

    terms = sorted({t for b in report["blocks"] for t in b["energy"]})
    fig, axes = plt.subplots(1, len(terms), figsize=(4.5 * len(terms), 0.25 * len(tokens) + 2.0), squeeze=False)
    for ax, term in zip(axes.flat, terms):
        cols_data, labels = [], []
        for b in report["blocks"]:
            if term in b["energy"]:
                e = torch.tensor(b["energy"][term])
                cols_data.append(e - e[:1])
                labels += [f"{b['layer']}.{t}" for t in range(e.shape[0])]
        mat = torch.cat(cols_data).T  # (N, columns)
        im = ax.imshow(mat, aspect="auto", cmap="coolwarm", interpolation="nearest",
                       vmin=-float(mat.abs().max()) or -1, vmax=float(mat.abs().max()) or 1)
        ax.set_title(f"{term}: E(x^t) − E(x^0)", fontsize=9)
        ax.set_yticks(range(len(tokens)))
        ax.set_yticklabels([repr(t)[1:-1] for t in tokens], fontsize=6)
        step = max(1, len(labels) // 16)
        ax.set_xticks(range(0, len(labels), step))
        ax.set_xticklabels(labels[::step], fontsize=6, rotation=90)
        ax.set_xlabel("layer.step")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    heat_png = out_dir / "energy_heatmap.png"
    fig.savefig(heat_png, dpi=110)
    plt.close(fig)
    return [steps_png, heat_png]


def inspect_run(run_dir: str | Path, prompt: str, out_dir: str | Path, n_steps: int | None = None,
                stop_tol: float | None = None, device: str = "auto") -> dict[str, Any]:
    """Trace a trained run on ``prompt`` and write ``trace.json`` and the plots into ``out_dir``.

    Args:
        run_dir: a run directory of an energy model (NRGPT; CEM with ``rope`` exact or None).
        prompt: the text (encoded with the run's tokenizer, cropped to the last ``block_size`` tokens).
        out_dir: where ``trace.json``, ``energy_steps.png`` and ``energy_heatmap.png`` go.
        n_steps, stop_tol: NRGPT only: steps at inference and per-token early stopping.
        device: where the model runs.

    Returns:
        the report written to ``trace.json`` (``run``, ``arch``, ``prompt``, ``tokens``, ``blocks``,
        ``steps_taken``, ``files``).

    Raises:
        FileNotFoundError: not a run directory.
        ValueError: an empty prompt or one the tokenizer cannot encode, a model without energies,
            ``n_steps``/``stop_tol`` given for a model other than NRGPT.
    """
    from energyformer.data import load_tokenizer
    from energyformer.runs.rundir import load_run
    from energyformer.utils.device import configure_backends, resolve_device
    from energyformer.utils.io import atomic_write_json

    dev = resolve_device(device)
    configure_backends(dev)
    model, run_cfg, meta = load_run(run_dir, device=dev)
    tokenizer = load_tokenizer(meta)
    try:
        ids = tokenizer.encode(prompt)
    except (KeyError, ValueError) as e:
        raise ValueError(f"cannot encode the prompt with the run's {meta.get('tokenizer')!r} tokenizer: {e}") from None
    if not ids:
        raise ValueError("the prompt is empty; give at least one character")
    ids = ids[-model.config.block_size:]
    kwargs = {k: v for k, v in (("n_steps", n_steps), ("stop_tol", stop_tol)) if v is not None}
    if kwargs and run_cfg.model.arch != "nrgpt":
        raise ValueError(f"n_steps/stop_tol at inference are NRGPT options; the run's arch is {run_cfg.model.arch!r}")
    report = energy_report(model, torch.tensor([ids], device=dev), **kwargs)
    tokens = [tokenizer.decode([i]) for i in ids]
    files = plot_report(report, tokens, out_dir)
    out = {"run": str(run_dir), "arch": run_cfg.model.arch, "prompt": prompt, "tokens": tokens, **report,
           "files": [p.name for p in files] + ["trace.json"]}
    atomic_write_json(Path(out_dir) / "trace.json", out)
    return out


def format_inspect(report: dict[str, Any]) -> str:
    """A short text summary: per block, mean energy per term at the first and last step, mean cos."""
    lines = [f"{report['arch']} on {len(report['tokens'])} tokens; wrote {', '.join(report['files'])}"]
    for b in report["blocks"]:
        terms = ", ".join(f"{t} {sum(e[0]) / len(e[0]):.4g} → {sum(e[-1]) / len(e[-1]):.4g}"
                          for t, e in b["energy"].items())
        cos = [c for row in b["cos"] for c in row]
        lines.append(f"  layer {b['layer']} {b['sub']} ({b['steps']} steps): mean energy {terms}; "
                     f"mean cos(Δx, −∇E) {sum(cos) / max(1, len(cos)):.3f}")
    return "\n".join(lines)


__all__ = ["energy_report", "format_inspect", "inspect_run", "plot_report", "report_from_trace"]
