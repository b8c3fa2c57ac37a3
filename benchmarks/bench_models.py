"""Speed and memory of energy models against their baselines, measured in the same run.

Each row times forward+backward (training step without the optimizer) and forward-only
(inference) of one model at the Shakespeare recipe size, and reports the ratio to the row's
baseline (these machines are noisy, so only ratios within one run mean anything).

    python benchmarks/bench_models.py                 # table + results/bench_models.json
    python benchmarks/bench_models.py --quick         # fewer repeats (CI smoke)
    python benchmarks/bench_models.py --device cuda --batch-size 64 --block-size 256

Writes a JSON file with the environment, the settings and every row.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_results

from energyformer import build_model

# (name, baseline name, model config); sizes match configs/shakespeare_char/*.yaml widths.
D, H, L = 128, 4, 4
ROWS = [
    ("llama", "llama", dict(arch="llama", d_model=D, n_layers=L, n_heads=H, d_ff=352)),
    ("cem tied T=1", "llama", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352, n_steps=1,
                                   interaction="lowrank", rope="llama")),
    ("cem T=2", "llama", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352, n_steps=2,
                              interaction="lowrank")),
    ("cem diag_shared", "llama", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352,
                                      interaction="diag_shared")),
    ("cem diag_per_head", "llama", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352,
                                        interaction="diag_per_head")),
    ("cem full (T=2+diag+P)", "llama", dict(arch="cem", d_model=D, n_layers=L, n_heads=H, d_ff=352, n_steps=2,
                                            interaction="diag_shared", preconditioner="diag_lowrank")),
    ("gpt", "gpt", dict(arch="gpt", d_model=D, n_layers=L, n_heads=H)),
    ("gpt_rec_parallel", "gpt_rec_parallel", dict(arch="gpt_rec", d_model=D, n_steps=L, n_heads=H, parallel=True)),
    ("nrgpt ff2w", "gpt_rec_parallel", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H, ff="ff2w")),
    ("nrgpt ff1", "gpt_rec_parallel", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H, ff="ff1")),
    ("nrgpt factored", "gpt_rec_parallel", dict(arch="nrgpt", d_model=D, n_steps=L, n_heads=H, attention="factored")),
]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_model(cfg: dict, batch: int, block: int, vocab: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    model = build_model({**cfg, "vocab_size": vocab, "block_size": block}).to(device)
    idx = torch.randint(0, vocab, (batch, block), device=device)

    def train_step():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets=idx)
        loss.backward()

    def infer_step():
        with torch.no_grad():
            model(idx)

    out = {"params": model.num_params()}
    for name, fn in (("train_ms", train_step), ("infer_ms", infer_step)):
        fn(); fn()  # warm-up (first calls pay for allocation and kernel selection)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        train_step()
        out["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=74)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 repeats, batch 4 (smoke test)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/bench_models.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.batch_size = 3, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, base = [], {}
    for name, baseline, cfg in ROWS:
        r = time_model(cfg, args.batch_size, args.block_size, args.vocab_size, args.repeats, args.device)
        r.update(name=name, baseline=baseline)
        if name == baseline:
            base[name] = r
        b = base[baseline]
        r["train_ratio"] = r["train_ms"] / b["train_ms"]
        r["infer_ratio"] = r["infer_ms"] / b["infer_ms"]
        r["params_ratio"] = r["params"] / b["params"]
        rows.append(r)
    header = f"{'model':<24}{'baseline':<18}{'params':>10}{'train ms':>10}{'ratio':>7}{'infer ms':>10}{'ratio':>7}"
    print(f"batch {args.batch_size} x block {args.block_size}, device {args.device}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<24}{r['baseline']:<18}{r['params']:>10,}{r['train_ms']:>10.1f}{r['train_ratio']:>7.2f}"
              f"{r['infer_ms']:>10.1f}{r['infer_ratio']:>7.2f}")
    write_results(args.out, args.device, vars(args), rows)
    return rows


if __name__ == "__main__":
    main()
