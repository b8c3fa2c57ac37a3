"""Generation speed with and without the key/value cache, per family, measured in the same run.

For each family at the Shakespeare recipe width (d_model 128, 4 heads, 4 layers or recurrent
steps) and each length, one prompt of 16 tokens is continued by 64 / 256 / 512 sampled tokens
(temperature 0.8, top-k 40, one seed) with ``generate(..., use_cache=True)`` and with
``use_cache=False``; the table gives generated tokens per second and their ratio. ``block_size``
is 1024, so every length fits in the context and both paths see the same context (past
``block_size`` the cached path restarts its cache, docs/architecture.md §5).

    python benchmarks/bench_generate.py                       # table + JSON
    python benchmarks/bench_generate.py --quick               # d_model 32, 2 families, 16 tokens (smoke test)
    python benchmarks/bench_generate.py --check               # exit 1 when a goal is missed
    python benchmarks/bench_generate.py --device cuda --batch-size 8

These machines are shared and noisy: only the ratio within one run means anything.

Goal (issue 10; ``--check`` exits 1 naming each miss with its numbers): cached generation ≥ 5×
faster than uncached at 512 new tokens, every family.

Writes benchmarks/results/bench_generate-<device>.json (environment, settings, every row).
"""
from __future__ import annotations

import argparse
import sys

import torch
from common import MODEL_SHAPES, find_name, finish, goal, interleaved_median_ms, parse_args, profile_table, run_main

from energyformer import build_model

_S = MODEL_SHAPES["d128"]
D, H, L, D_FF = _S.d_model, _S.n_heads, _S.depth, _S.d_ff
SPEEDUP_GOAL, GOAL_TOKENS = 5.0, 512
FAMILIES = [
    ("gpt", dict(arch="gpt", d_model=D, n_layers=L, n_heads=H)),
    ("llama", dict(arch="llama", d_model=D, n_layers=L, n_heads=H, d_ff=D_FF)),
    ("cem T=1", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=D_FF)),
    ("cem T=2 diag_shared+P", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=D_FF, n_steps=2,
                                   interaction="diag_shared", preconditioner="diag_lowrank")),
    ("gpt_rec_parallel", dict(arch="gpt_rec", d_model=D, n_steps=L, n_heads=H, parallel=True)),
    ("nrgpt ff2w", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H)),
    ("nrgpt factored", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H, attention="factored")),
]


def time_generate(model, idx, n_new: int, repeats: int, device: str) -> tuple[float, float]:
    """Median seconds of ``generate`` for ``n_new`` tokens with and without the cache, the two
    timed in turn (same seed, so both sample the same tokens)."""
    def run(use_cache: bool):
        def call():
            gen = torch.Generator(device=device).manual_seed(0)
            model.generate(idx, n_new, temperature=0.8, top_k=40, generator=gen, use_cache=use_cache)
        return call

    ms = interleaved_median_ms({"cached": run(True), "uncached": run(False)}, repeats, device, warmup=0)
    return ms["cached"] / 1e3, ms["uncached"] / 1e3


def row_goals(row: dict) -> list[dict]:
    """The cached-generation goal, for rows at 512 new tokens."""
    if row["new_tokens"] != GOAL_TOKENS:
        return []
    return [goal(f"cached speed-up at {GOAL_TOKENS} tokens", row["ratio"], ">=", SPEEDUP_GOAL)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="new tokens (default 64 256 512; 16 with --quick)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=74)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="d_model 32, 2 families, 16 new tokens (smoke test)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed (each miss is printed)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", metavar="FAMILY", default=None,
                    help="print the torch.profiler table of this family's generation of the first --lengths "
                         "tokens (with the cache; --no-cache: without) and exit")
    ap.add_argument("--no-cache", action="store_true", help="--profile the uncached generation")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_generate-<device>.json)")
    args = parse_args(ap, argv)
    if args.lengths is None:
        args.lengths = [16] if args.quick else [64, 256, 512]
    families = FAMILIES[:2] if args.quick else FAMILIES
    if args.profile:
        key = find_name(args.profile, [n for n, _ in FAMILIES])
        cfg = {**dict(FAMILIES)[key], **({"d_model": 32} if args.quick else {})}
        torch.manual_seed(0)
        model = build_model({**cfg, "vocab_size": args.vocab_size, "block_size": args.block_size})
        model = model.to(args.device).eval()
        idx = torch.randint(0, args.vocab_size, (args.batch_size, args.prompt_len), device=args.device)
        n_new, use_cache = args.lengths[0], not args.no_cache

        def step():
            gen = torch.Generator(device=args.device).manual_seed(0)
            model.generate(idx, n_new, temperature=0.8, top_k=40, generator=gen, use_cache=use_cache)

        head = (f"profile of {key!r}: {n_new} new tokens {'with' if use_cache else 'without'} the cache, "
                f"prompt {args.prompt_len}, batch {args.batch_size}, 1 call, device {args.device}")
        print(profile_table(step, args.device, head, steps=1))
        return 0
    rows = []
    for name, cfg in families:
        torch.manual_seed(0)
        cfg = {**cfg, "d_model": 32} if args.quick else cfg
        model = build_model({**cfg, "vocab_size": args.vocab_size, "block_size": args.block_size})
        model = model.to(args.device).eval()
        idx = torch.randint(0, args.vocab_size, (args.batch_size, args.prompt_len), device=args.device)
        for use_cache in (True, False):  # warm-up
            model.generate(idx, 4, use_cache=use_cache)
        for n_new in args.lengths:
            t_cached, t_plain = time_generate(model, idx, n_new, args.repeats, args.device)
            rows.append({"family": name, "new_tokens": n_new, "params": model.num_params(),
                         "cached_tok_s": args.batch_size * n_new / t_cached,
                         "uncached_tok_s": args.batch_size * n_new / t_plain,
                         "ratio": t_plain / t_cached})
            rows[-1]["goals"] = row_goals(rows[-1])
    header = f"{'family':<24}{'new tokens':>11}{'uncached tok/s':>16}{'cached tok/s':>14}{'ratio':>8}"
    print(f"prompt {args.prompt_len}, batch {args.batch_size}, block {args.block_size}, device {args.device}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats} interleaved")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['family']:<24}{r['new_tokens']:>11}{r['uncached_tok_s']:>16.1f}{r['cached_tok_s']:>14.1f}"
              f"{r['ratio']:>8.1f}")
    return finish("bench_generate", args, vars(args), rows)


if __name__ == "__main__":
    sys.exit(run_main(main))
