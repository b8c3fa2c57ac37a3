"""Markdown tables of the benchmark results: what benchmarks/README.md shows, generated from the
JSON files the benchmark scripts wrote, never typed.

One section per JSON file (the script, the machine and the settings in its heading), one table
per script layout, with a goal column (each goal and its target) and a met / missed column
holding the measured value; a line at the end of each section counts the goals met.

    python benchmarks/report.py                              # every benchmarks/results/*.json
    python benchmarks/report.py --results DIR                # every DIR/*.json
    python benchmarks/report.py a.json b.json --out tables.md
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import run_main

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ["bench_layers", "bench_models", "bench_generate"]
Column = tuple[str, Callable[[dict[str, Any]], str]]


def _f(key: str, fmt: str = "{:.2f}") -> Callable[[dict[str, Any]], str]:
    def cell(r: dict[str, Any]) -> str:
        v = r.get(key)
        return "-" if v is None else fmt.format(v)
    return cell


def goal_text(r: dict[str, Any]) -> str:
    """``name ≤ target`` of every goal of a row (``-`` without goals)."""
    sym = {"<=": "≤", ">=": "≥"}
    return "; ".join(f"{g['goal']} {sym.get(g['op'], g['op'])} {g['target']:g}" for g in r.get("goals", [])) or "-"


def met_text(r: dict[str, Any]) -> str:
    """``met (value)`` or ``**missed** (value)`` per goal of a row."""
    return "; ".join(("met" if g["met"] else "**missed**") + f" ({g['value']:.2f})"
                     for g in r.get("goals", [])) or "-"


GOAL_COLUMNS: list[Column] = [("goal", goal_text), ("met?", met_text)]

LAYER_COLUMNS: list[Column] = [
    ("shape (d, H, N, B)", lambda r: str(tuple(r["shape"]))), ("row", lambda r: r["row"]),
    ("peer", lambda r: r["peer"]), ("ms", _f("ms", "{:.1f}")), ("time / peer", _f("time_ratio")),
    ("FLOPs / peer", _f("flop_ratio")), ("cost / bound", _f("cost_over_bound")),
]
MODEL_COLUMNS: list[Column] = [
    ("model", lambda r: r["name"]), ("baseline", lambda r: r["baseline"]), ("params", _f("params", "{:,}")),
    ("train tok/s", _f("train_tok_s", "{:,.0f}")), ("time / base", _f("train_ratio")),
    ("FLOPs / base", _f("flop_ratio")), ("cost / bound", _f("cost_over_bound")),
    ("MFLOP / token", lambda r: f"{r['flops_per_token'] / 1e6:.1f}"), ("MFU", _f("mfu", "{:.1%}")),
    ("infer time / base", _f("infer_ratio")),
    ("activations MiB", lambda r: f"{r.get('peak_mb', r.get('saved_mb', 0)):.1f}"),
]
COMPILE_COLUMNS: list[Column] = [
    ("compiled tok/s",
     lambda r: f"{r['compiled_tok_s']:,.0f}" if "compiled_tok_s" in r else r.get("compile_error", "-")),
    ("compiled MFU", _f("compiled_mfu", "{:.1%}")), ("eager / compiled", _f("compile_speedup")),
    ("compile s", _f("compile_s", "{:.0f}")),
]
CHECKPOINT_COLUMNS: list[Column] = [
    ("family", lambda r: r["family"]), ("memory measure", lambda r: r["memory"]),
    ("T=1 MiB", lambda r: f"{r['t1_' + r['memory']]:.1f}"), ("T=4 MiB", lambda r: f"{r['t4_' + r['memory']]:.1f}"),
    ("T=4 checkpointed MiB", lambda r: f"{r['t4_ckpt_' + r['memory']]:.1f}"), ("T=4 / T=1", _f("t4_over_t1")),
    ("T=4 checkpointed / T=1", _f("t4_ckpt_over_t1")), ("time with / without", _f("recompute_time_ratio")),
]
GENERATE_COLUMNS: list[Column] = [
    ("family", lambda r: r["family"]), ("new tokens", _f("new_tokens", "{}")),
    ("uncached tok/s", _f("uncached_tok_s", "{:.1f}")), ("cached tok/s", _f("cached_tok_s", "{:.1f}")),
    ("cached / uncached", _f("ratio", "{:.1f}")),
]


def table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    """A markdown table of ``rows`` (``|`` inside a cell is escaped)."""
    head = [name for name, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(fn(r)).replace("|", "\\|") for _, fn in columns) + " |")
    return "\n".join(lines)


def generic_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """Every scalar field of the rows, for a script this module has no layout for."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if k not in keys and isinstance(v, (int, float, str)) and k != "goals"]
    return [(k, _cell_of(k)) for k in keys]


def _cell_of(key: str) -> Callable[[dict[str, Any]], str]:
    """The formatter of one generic column: floats to 3 significant digits, a missing field as '-'."""
    def cell(r: dict[str, Any]) -> str:
        return f"{r[key]:.3g}" if isinstance(r.get(key), float) else str(r.get(key, "-"))
    return cell


def script_of(data: dict[str, Any], path: Path) -> str:
    """The benchmark that wrote ``data``: its ``script`` field, else the file name up to ``-``."""
    return data.get("script") or path.stem.split("-")[0]


def heading(script: str, data: dict[str, Any], path: Path) -> str:
    env, st = data.get("env", {}), data.get("settings", {})
    where = env.get("gpu") or env.get("cpu") or env.get("machine", "?")
    bits = [f"torch {env.get('torch', '?')}", f"{env.get('device', '?')} ({where})",
            f"{env.get('threads', '?')} threads"]
    if script == "bench_layers":
        bits.append(f"shapes {st.get('shapes', '?')}, median of {st.get('repeats', '?')}")
    elif script == "bench_models":
        shape = st.get("model_shape", {})
        bits.append(", ".join(f"{k} {v}" for k, v in shape.items()))
        bits.append(f"{st.get('precision', 'fp32')}, median of {st.get('repeats', '?')}")
        if st.get("peak_flops"):
            bits.append(f"matmul peak {st['peak_flops'] / 1e9:.1f} GFLOP/s ({st.get('peak_n', '?')}³)")
    elif script == "bench_generate":
        bits.append(f"prompt {st.get('prompt_len', '?')}, batch {st.get('batch_size', '?')}, "
                    f"median of {st.get('repeats', '?')}")
    if st.get("quick"):
        bits.append("**--quick (smoke run, not a measurement)**")
    return f"### {script}: {path.name}\n\n" + "; ".join(bits)


def render(data: dict[str, Any], path: Path) -> str:
    """The markdown section of one results file."""
    script, rows = script_of(data, path), data.get("rows", [])
    parts = [heading(script, data, path)]
    if script == "bench_layers":
        parts.append(table(rows, LAYER_COLUMNS + GOAL_COLUMNS))
    elif script == "bench_models":
        fam = [r for r in rows if "baseline" in r]
        ck = [r for r in rows if "family" in r]
        compiled = any("compiled_ms" in r or "compile_error" in r for r in fam)
        parts.append(table(fam, MODEL_COLUMNS + (COMPILE_COLUMNS if compiled else []) + GOAL_COLUMNS))
        if ck:
            parts.append(table(ck, CHECKPOINT_COLUMNS + GOAL_COLUMNS))
    elif script == "bench_generate":
        parts.append(table(rows, GENERATE_COLUMNS + GOAL_COLUMNS))
    else:
        parts.append(table(rows, generic_columns(rows) + GOAL_COLUMNS))
    goals = [g for r in rows for g in r.get("goals", [])]
    parts.append(f"Goals met: {sum(g['met'] for g in goals)} of {len(goals)}.")
    return "\n\n".join(parts)


def result_files(paths: list[str], results: str | Path) -> list[Path]:
    """``paths``, or every ``*.json`` under ``results``, benchmark scripts in ``ORDER`` first.

    Raises:
        FileNotFoundError: a named file does not exist, or no JSON file was found.
    """
    if paths:
        files = [Path(p) for p in paths]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"results file {f} does not exist")
    else:
        if not Path(results).is_dir():
            raise FileNotFoundError(f"results folder {results} does not exist; expected the folder the benchmark "
                                    "scripts write (default benchmarks/results)")
        files = sorted(Path(results).glob("*.json"))
        if not files:
            raise FileNotFoundError(f"no *.json in {results}; run the benchmarks first (benchmarks/run_all.sh)")
    rank = {s: i for i, s in enumerate(ORDER)}
    return sorted(files, key=lambda f: (rank.get(f.stem.split("-")[0], len(ORDER)), f.name))


def report(files: list[Path]) -> str:
    """Every file's section, in order."""
    sections = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON ({e}); expected a file written by a benchmark script") from e
        if not isinstance(data, dict) or not {"env", "settings", "rows"} <= set(data):
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{f} is not a benchmark result: it holds {keys}; expected the keys env, settings "
                             "and rows that the benchmark scripts write")
        sections.append(render(data, f))
    return "\n\n".join(sections) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="results files (default: every *.json under --results)")
    ap.add_argument("--results", default=str(RESULTS), help="folder of results files")
    ap.add_argument("--out", default=None, help="write the markdown here instead of printing it")
    args = ap.parse_args(argv)
    text = report(result_files(args.files, args.results))
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
