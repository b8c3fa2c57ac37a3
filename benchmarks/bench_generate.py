"""Generation speed with and without the key/value cache, per family, measured in the same run.

For each family at the Shakespeare recipe width (d_model 128, 4 heads, 4 layers or recurrent
steps) and each length, one prompt of 16 tokens is continued by 64 / 256 / 512 sampled tokens
(temperature 0.8, top-k 40, one seed) with ``generate(..., use_cache=True)`` and with
``use_cache=False``; the table gives generated tokens per second and their ratio. ``block_size``
is 1024, so every length fits in the context and both paths see the same context (past
``block_size`` the cached path restarts its cache, docs/architecture.md §5).

    python benchmarks/bench_generate.py                       # table + benchmarks/results/bench_generate.json
    python benchmarks/bench_generate.py --lengths 64 --quick  # smoke test
    python benchmarks/bench_generate.py --device cuda --batch-size 8

These machines are shared and noisy: only the ratio within one run means anything.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import write_results

from energyformer import build_model

D, H, L = 128, 4, 4
FAMILIES = [
    ("gpt", dict(arch="gpt", d_model=D, n_layers=L, n_heads=H)),
    ("llama", dict(arch="llama", d_model=D, n_layers=L, n_heads=H, d_ff=352)),
    ("cem T=1", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352)),
    ("cem T=2 diag_shared+P", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352, n_steps=2,
                                   interaction="diag_shared", preconditioner="diag_lowrank")),
    ("gpt_rec_parallel", dict(arch="gpt_rec", d_model=D, n_steps=L, n_heads=H, parallel=True)),
    ("nrgpt ff2w", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H)),
    ("nrgpt factored", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H, attention="factored")),
]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generate(model, idx, n_new: int, use_cache: bool, repeats: int, device: str) -> float:
    """Median seconds of ``generate`` for ``n_new`` tokens."""
    times = []
    for r in range(repeats):
        gen = torch.Generator(device=device).manual_seed(r)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(idx, n_new, temperature=0.8, top_k=40, generator=gen, use_cache=use_cache)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=74)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="d_model 32, 2 families (smoke test)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_generate.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    families = FAMILIES[:2] if args.quick else FAMILIES
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
            t_cached = time_generate(model, idx, n_new, True, args.repeats, args.device)
            t_plain = time_generate(model, idx, n_new, False, args.repeats, args.device)
            rows.append({"family": name, "new_tokens": n_new, "params": model.num_params(),
                         "cached_tok_s": args.batch_size * n_new / t_cached,
                         "uncached_tok_s": args.batch_size * n_new / t_plain,
                         "ratio": t_plain / t_cached})
    header = f"{'family':<24}{'new tokens':>11}{'uncached tok/s':>16}{'cached tok/s':>14}{'ratio':>8}"
    print(f"prompt {args.prompt_len}, batch {args.batch_size}, block {args.block_size}, device {args.device}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['family']:<24}{r['new_tokens']:>11}{r['uncached_tok_s']:>16.1f}{r['cached_tok_s']:>14.1f}"
              f"{r['ratio']:>8.1f}")
    write_results(args.out, args.device, vars(args), rows)
    return rows


if __name__ == "__main__":
    main()
