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

The summary says whether the model's step map promises descent (:func:`descent_guarantee`: NRGPT's
``η = c·diag(γ)`` does, for a small enough step; a free η or CEM's preconditioners do not) and,
per block, whether the traced mean energy fell at every step or rose.

The figures stay at most 12 × 16 inches at 120 dpi whatever the prompt's length: at most 30 tick
labels per axis (every k-th token beyond), and past 10 tokens the step plot draws the mean over
tokens and their 10–90% band instead of one line per token.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from energyformer.layers.trace import Trace
from energyformer.models.registry import get_spec


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

    ``forward_kwargs`` go to the forward (NRGPT: ``n_steps``, ``stop_tol``; NRGPT and CEM:
    ``exit``, ``accept_lower_energy``, docs/inference_compute.md).

    Returns:
        ``{"blocks": report_from_trace(...), "steps_taken": (N,) list or None,
        "descent": descent_guarantee(model), "per_token": {"energy": (N,), "loss": (N,)},
        "energy_vs_loss": energy_loss_correlation(...)}``: each token's final energy
        (:func:`final_energy`) beside its next-token loss (the last token has no next token: ``None``)
        and their correlation over the tokens that have both (docs/inference_compute.md §6).

    Raises:
        ValueError: the model has no energies (GPT, Llama, recurrent GPT), or see :func:`report_from_trace`.
    """
    was_training = model.training
    model.eval()
    try:
        with model.trace() as trace:
            logits = model(idx, **forward_kwargs)[0]
    finally:
        model.train(was_training)
    taken = trace.steps_taken if trace.steps_taken is not None else getattr(model, "exit_steps", None)
    steps = None if taken is None else taken[0].tolist()
    blocks = report_from_trace(trace)
    energy = final_energy(blocks)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].double(), idx[0, 1:], reduction="none").cpu()
    return {"blocks": blocks, "steps_taken": steps, "descent": descent_guarantee(model),
            "per_token": {"energy": energy.tolist(), "loss": loss.tolist() + [None]},
            "energy_vs_loss": energy_loss_correlation(energy[:-1], loss)}


def final_energy(blocks: list[dict[str, Any]]) -> torch.Tensor:
    """Each token's energy after the last step ``(N,)``: the ``total`` term of a block that has one
    (NRGPT), else the sum of every term; summed over the blocks (CEM: every sub-block of every layer)."""
    out = None
    for b in blocks:
        terms = [b["energy"]["total"]] if "total" in b["energy"] else list(b["energy"].values())
        e = sum(torch.tensor(t[-1], dtype=torch.float64) for t in terms)
        out = e if out is None else out + e
    return out


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """Ranks 1 … n of ``v`` ``(n,)``, ties given their mean rank (for Spearman's ρ)."""
    _, inverse, counts = torch.unique(v, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)  # the last rank of each distinct value
    return ((ends - counts + 1 + ends) / 2)[inverse]  # the mean of its first and last rank


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return None if den == 0.0 else float((a * b).sum()) / den


def energy_loss_correlation(energy: torch.Tensor, loss: torch.Tensor) -> dict[str, Any]:
    """Pearson's r and Spearman's ρ between per-token energies and losses, both ``(n,)``
    (docs/inference_compute.md §6: the energy as an uncertainty signal).

    Returns:
        ``{"n": n, "pearson": r or None, "spearman": ρ or None}``: ``None`` for fewer than 3 tokens
        or a constant series.

    Raises:
        ValueError: ``energy`` and ``loss`` of different shapes or not 1-D.
    """
    energy, loss = torch.as_tensor(energy, dtype=torch.float64), torch.as_tensor(loss, dtype=torch.float64)
    if energy.dim() != 1 or energy.shape != loss.shape:
        raise ValueError(f"energy and loss must be 1-D of one length; got {tuple(energy.shape)} and "
                         f"{tuple(loss.shape)}")
    n = len(energy)
    if n < 3:
        return {"n": n, "pearson": None, "spearman": None}
    return {"n": n, "pearson": _pearson(energy, loss), "spearman": _pearson(_ranks(energy), _ranks(loss))}


#: NRGPT's step maps with a descent guarantee (docs/nrgpt.md §5), each with the norms under which it holds
_GUARANTEED: dict[str, tuple[str, tuple[str | None, ...]]] = {
    "c_diag_gamma": ("η = c·diag(γ)", ("layernorm", "rmsnorm", "layernorm_frozen")),
    "c_identity": ("η = c·I", ("layernorm_frozen", "none", None)),
    "psd_plus_skew": ("η = LLᵀ + (S − Sᵀ)", ("none", None)),
}
_NAMES = {"full": "η a free d×d map", **{k: v[0] for k, v in _GUARANTEED.items()}}


def descent_guarantee(model: torch.nn.Module) -> dict[str, Any]:
    """Whether the theory promises that ``model``'s steps lower its energy (docs/nrgpt.md §5).

    Guaranteed, for a small enough step: NRGPT with ``η = c·diag(γ)`` (a norm with a scale),
    ``η = c·I`` (frozen ``γ = 1`` or no norm) or ``η = LLᵀ + (S − Sᵀ)`` (no norm), and positive
    per-step scales ``κ_t`` if any. Every other ``η`` (the free ``full`` map, CEM's kinds) and every
    CEM preconditioner: no guarantee (docs/cem.md §9).

    Returns:
        ``{"guaranteed": bool, "summary": one line in plain words}``.
    """
    cfg = model.config
    eta, norm = getattr(cfg, "eta_param", None), getattr(cfg, "norm", None)
    if eta is None:  # CEM (and any model without an η): the preconditioner P is its step map
        pre = getattr(cfg, "preconditioner", None)
        what = f"CEM with preconditioner {pre}" if pre else "CEM without a preconditioner"
        return {"guaranteed": False, "summary": f"{what}: no descent guarantee: the energy may rise "
                                                "(docs/cem.md §9)"}
    name = f"{_NAMES.get(eta, f'η = {eta}')} (eta_param {eta}, norm {norm})"
    if eta not in _GUARANTEED or norm not in _GUARANTEED[eta][1]:
        return {"guaranteed": False, "summary": f"{name}: no descent guarantee: the energy may rise "
                                                "(docs/nrgpt.md §5)"}
    kappa = getattr(model, "step_scales", None)
    if kappa is not None and bool((kappa <= 0).any()):
        bad = ", ".join(str(t) for t in (kappa <= 0).nonzero().flatten().tolist())
        return {"guaranteed": False, "summary": f"{name} but per-step scale κ ≤ 0 at step index {bad}: "
                                                "no descent guarantee: the energy may rise (docs/nrgpt.md §5)"}
    return {"guaranteed": True, "summary": f"{name}: descent guaranteed for a small enough step "
                                           "(docs/nrgpt.md §5)"}


def mean_energy_steps(block: dict[str, Any]) -> list[float]:
    """The mean over tokens of a report block's energy at each step ``x⁰ … x^S``: its ``total``
    term if it has one (NRGPT), else the sum of its terms (a CEM sub-block has one)."""
    terms = [block["energy"]["total"]] if "total" in block["energy"] else list(block["energy"].values())
    return [sum(sum(e[t]) / len(e[t]) for e in terms) for t in range(block["steps"] + 1)]


def energy_trend(means: Sequence[float]) -> str:
    """In words, how the mean energy ``E(x⁰) … E(x^S)`` moved: ``"falls at every step"``,
    ``"falls overall, rises at step 2"`` or ``"RISES over the steps (up at steps 1, 2)"``; a step
    ``t`` is the move from ``x^{t−1}`` to ``x^t``."""
    up = [t for t in range(1, len(means)) if means[t] > means[t - 1]]
    at = f"step{'s' if len(up) > 1 else ''} {', '.join(map(str, up))}"
    if not up:
        return "falls at every step"
    if means[-1] > means[0]:
        return f"RISES over the steps (up at {at})"
    return f"falls overall, rises at {at}"


MAX_WIDTH_IN, MAX_HEIGHT_IN, DPI = 12.0, 16.0, 120  # every figure fits 1440 × 1920 pixels
MAX_TICKS = 30  # tick labels per axis; beyond, every k-th
MAX_TOKEN_LINES = 10  # per-token lines in energy_steps.png; beyond, the mean and a 10–90% band
TICK_PT, LABEL_PT, TITLE_PT = 9, 10, 11  # font sizes (points) of tick labels, axis labels and legends, titles


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def thinned_ticks(n: int, max_ticks: int = MAX_TICKS) -> range:
    """Every k-th of ``n`` positions, with the smallest ``k`` that keeps at most ``max_ticks``."""
    return range(0, n, max(1, -(-n // max_ticks)))


def _token_labels(tokens: Sequence[str]) -> list[str]:
    return [f"{i} {repr(t)[1:-1]}" for i, t in enumerate(tokens)]


def _draw_tokens(ax: Any, e: torch.Tensor, tokens: Sequence[str], legend: bool) -> None:
    """Energy vs step of each token ``e`` ``(S + 1, N)``: one labelled line per token when few,
    else the mean over tokens and the band between their 10th and 90th percentiles (labelled too);
    ``legend``: show the labels on this panel."""
    steps = range(e.shape[0])
    if e.shape[1] <= MAX_TOKEN_LINES:
        for label, col in zip(_token_labels(tokens), e.T):
            ax.plot(steps, col.numpy(), marker=".", linewidth=1, label=label)
    else:
        lo, hi = torch.quantile(e, torch.tensor([0.1, 0.9], dtype=e.dtype), dim=1)
        ax.fill_between(steps, lo.numpy(), hi.numpy(), alpha=0.25, label="10–90% of tokens")
        ax.plot(steps, e.mean(dim=1).numpy(), marker=".", linewidth=1.5, label=f"mean over {e.shape[1]} tokens")
    if legend:
        ax.legend(fontsize=TICK_PT, loc="best", title="position token" if e.shape[1] <= MAX_TOKEN_LINES else None,
                  title_fontsize=TICK_PT)


def steps_figure(report: dict[str, Any], tokens: Sequence[str]) -> Any:
    """Energy vs descent step, a panel per (block, term), at most 12 × 16 inches (the caller closes it)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    panels = [(b, term) for b in report["blocks"] for term in b["energy"]]
    cols = min(3 if len(tokens) > MAX_TOKEN_LINES else 2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(MAX_WIDTH_IN if cols > 1 else 6.0, min(MAX_HEIGHT_IN, 3.0 * rows)),
                             squeeze=False)
    for i, (ax, (b, term)) in enumerate(zip(axes.flat, panels)):
        _draw_tokens(ax, torch.tensor(b["energy"][term], dtype=torch.float64), tokens, legend=i == 0)
        ax.set_title(f"layer {b['layer']} {b['sub']}: {term}", fontsize=TITLE_PT)
        ax.set_xlabel("descent step t", fontsize=LABEL_PT)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("energy E(x^t) per token", fontsize=LABEL_PT)
        ax.tick_params(labelsize=TICK_PT)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"energy vs step on {len(tokens)} tokens", fontsize=TITLE_PT + 1)
    fig.tight_layout()
    return fig


def heatmap_figure(report: dict[str, Any], tokens: Sequence[str]) -> Any:
    """Token × step heat map of each term's energy change ``E(x^t) − E(x⁰)``, ``t = 1 … S`` (step 0,
    zero by definition, is left out), at most 12 × 16 inches and :data:`MAX_TICKS` tick labels per
    axis (the caller closes it). Columns are labelled ``step t``, or ``L{layer} s{t}`` when a term
    spans several layers (CEM)."""
    plt = _pyplot()

    terms = sorted({t for b in report["blocks"] for t in b["energy"]})
    size = (min(MAX_WIDTH_IN, 4.5 * len(terms)), min(10.0, 0.25 * len(tokens) + 2.5))
    fig, axes = plt.subplots(1, len(terms), figsize=size, squeeze=False)
    names = _token_labels(tokens)
    for ax, term in zip(axes.flat, terms):
        blocks = [b for b in report["blocks"] if term in b["energy"]]
        cols_data, labels = [], []
        for b in blocks:
            e = torch.tensor(b["energy"][term])
            cols_data.append(e[1:] - e[:1])
            steps = range(1, e.shape[0])
            labels += [f"step {t}" for t in steps] if len(blocks) == 1 else [f"L{b['layer']} s{t}" for t in steps]
        mat = torch.cat(cols_data).T  # (N, columns)
        im = ax.imshow(mat.numpy(), aspect="auto", cmap="coolwarm", interpolation="nearest",
                       vmin=-float(mat.abs().max()) or -1, vmax=float(mat.abs().max()) or 1)
        ax.set_title(f"{term}: E(x^t) − E(x^0)", fontsize=TITLE_PT)
        rows, cols = thinned_ticks(len(tokens)), thinned_ticks(len(labels))
        ax.set_yticks(list(rows), [names[i] for i in rows], fontsize=TICK_PT)
        ax.set_xticks(list(cols), [labels[i] for i in cols], fontsize=TICK_PT,
                      rotation=90 if len(cols) * max(map(len, labels)) > 40 else 0)
        ax.set_xlabel("descent step t" if len(blocks) == 1 else "layer L, descent step s", fontsize=LABEL_PT)
        ax.set_ylabel("position token" + (f" (1 in {rows.step} labelled)" if rows.step > 1 else ""),
                      fontsize=LABEL_PT)
        bar = fig.colorbar(im, ax=ax, fraction=0.046)
        bar.set_label("energy change per token", fontsize=LABEL_PT)
        bar.ax.tick_params(labelsize=TICK_PT)
    fig.tight_layout()
    return fig


def plot_report(report: dict[str, Any], tokens: Sequence[str], out_dir: str | Path) -> list[Path]:
    """``energy_steps.png`` (:func:`steps_figure`) and ``energy_heatmap.png`` (:func:`heatmap_figure`),
    at :data:`DPI` dots per inch.

    Returns:
        the paths written.
    """
    plt = _pyplot()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in (("energy_steps.png", steps_figure), ("energy_heatmap.png", heatmap_figure)):
        fig = make(report, tokens)
        fig.savefig(out_dir / name, dpi=DPI)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def inspect_run(run_dir: str | Path, prompt: str, out_dir: str | Path, n_steps: int | None = None,
                stop_tol: float | None = None, device: str = "auto", exit: str | None = None,
                accept_lower_energy: bool = False) -> dict[str, Any]:
    """Trace a trained run on ``prompt`` and write ``trace.json`` and the plots into ``out_dir``.

    Args:
        run_dir: a run directory of an energy model (NRGPT; CEM with ``rope`` exact or None), or
            ``zoo:NAME`` (opened by :func:`energyformer.runs.rundir.open_run`, which warns when a
            training still holds the run).
        prompt: the text (encoded with the run's tokenizer, cropped to the last ``block_size`` tokens).
        out_dir: where ``trace.json``, ``energy_steps.png`` and ``energy_heatmap.png`` go.
        n_steps, stop_tol: steps at inference (NRGPT, CEM) and per-token early stopping (NRGPT).
        device: where the model runs (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``).
        exit, accept_lower_energy: per-token adaptive exit (``"rel:0.03"`` ...) and energy-safe
            steps (docs/inference_compute.md); the steps each token got are ``steps_taken``.

    Returns:
        the report written to ``trace.json`` (``run``, ``arch``, ``prompt``, ``tokens``, ``blocks``,
        ``steps_taken``, ``descent``, ``per_token``, ``energy_vs_loss``, ``files``).

    Raises:
        FileNotFoundError: not a run directory, or ``zoo:NAME`` naming no entry.
        ValueError: an unavailable ``device``, an empty prompt or one the tokenizer cannot encode, a
            model without energies, an option the model's forward does not take (e.g. ``stop_tol``
            for CEM), a bad ``exit``.
    """
    from energyformer.runs.rundir import open_run
    from energyformer.utils.io import atomic_write_json

    model, run_cfg, meta, tokenizer, dev, _ = open_run(run_dir, device)
    try:
        ids = tokenizer.encode(prompt)
    except (KeyError, ValueError) as e:
        raise ValueError(f"cannot encode the prompt with the run's {meta.get('tokenizer')!r} tokenizer: {e}") from None
    if not ids:
        raise ValueError("the prompt is empty; give at least one character")
    n_prompt, block = len(ids), model.config.block_size
    ids = ids[-block:]
    kwargs = {k: v for k, v in (("n_steps", n_steps), ("stop_tol", stop_tol), ("exit", exit),
                                ("accept_lower_energy", accept_lower_energy or None)) if v is not None}
    get_spec(run_cfg.model.arch).check_inference_options(kwargs)
    report = energy_report(model, torch.tensor([ids], device=dev), **kwargs)
    tokens = [tokenizer.decode([i]) for i in ids]
    files = plot_report(report, tokens, out_dir)
    out = {"run": str(run_dir), "arch": run_cfg.model.arch, "prompt": prompt, "tokens": tokens,
           "dropped_tokens": n_prompt - len(ids), "block_size": block, **report,
           "files": [p.name for p in files] + ["trace.json"], "out_dir": str(out_dir)}
    atomic_write_json(Path(out_dir) / "trace.json", out)
    return out


def format_inspect(report: dict[str, Any]) -> str:
    """A short text summary: whether the model's step map guarantees descent (:func:`descent_guarantee`),
    then per block the mean energy per term at the first and last step, whether it fell at every
    step or rose (:func:`energy_trend`), and the mean cos."""
    n = len(report["tokens"])
    where = f" in {report['out_dir']}" if report.get("out_dir") else ""
    lines = [f"{report['arch']} on {n} token{'s' if n != 1 else ''}; wrote {', '.join(report['files'])}{where}"]
    if report.get("dropped_tokens"):
        lines.insert(0, f"warning: the prompt has {report['dropped_tokens'] + n} tokens, more than the model's "
                        f"block_size={report['block_size']}: traced its last {n}, the first "
                        f"{report['dropped_tokens']} dropped")
    if report.get("descent"):
        lines.append(f"  {report['descent']['summary']}")
    corr = report.get("energy_vs_loss")
    if corr:
        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:+.3f}"

        lines.append(f"  final energy vs next-token loss over {corr['n']} tokens: Pearson {fmt(corr['pearson'])}, "
                     f"Spearman {fmt(corr['spearman'])} (per token in trace.json: per_token)")
    if report.get("steps_taken"):
        st = report["steps_taken"]
        lines.append(f"  steps per token: mean {sum(st) / len(st):.2f}, min {min(st)}, max {max(st)}")
    for b in report["blocks"]:
        terms = ", ".join(f"{t} {sum(e[0]) / len(e[0]):.4g} → {sum(e[-1]) / len(e[-1]):.4g}"
                          for t, e in b["energy"].items())
        cos = [c for row in b["cos"] for c in row]
        lines.append(f"  layer {b['layer']} {b['sub']} ({b['steps']} steps): mean energy {terms} "
                     f"({energy_trend(mean_energy_steps(b))}); mean cos(Δx, −∇E) {sum(cos) / max(1, len(cos)):.3f}")
    return "\n".join(lines)


__all__ = ["descent_guarantee", "energy_loss_correlation", "energy_report", "energy_trend", "final_energy",
           "format_inspect", "heatmap_figure", "inspect_run", "mean_energy_steps", "plot_report", "report_from_trace",
           "steps_figure"]
