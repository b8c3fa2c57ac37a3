"""In-context Gaussian-process regression data (docs/cem.md §9; ``energyformer prepare gp``).

Each sequence holds ``n_points`` pairs ``(x_i, y_i)``: ``x_i ~ U[-1, 1]^x_dim`` i.i.d.,
``f ~ GP(0, k)`` with the RBF kernel ``k(x, x') = variance · exp(−‖x − x'‖² / (2 length_scale²))``
drawn jointly at the ``n_points`` inputs, and ``y_i = f(x_i) + noise · ε_i`` with
``ε_i ~ N(0, 1)``. A model reads ``x_1, y_1, …, x_i`` and predicts ``y_i``; the exact GP
posterior mean with this kernel (:mod:`energyformer.tasks.gp`) is the Bayes-optimal predictor.

Everything is drawn in float64 from one ``torch.Generator`` seeded with ``seed`` (train, then
validation, then test), so the same settings give the same arrays, and is stored as float32.

Files (``data/gp``): ``{train,val,test}.npy``, each ``(n_sequences, n_points, x_dim + 1)``
float32 (the last column is ``y``), and ``meta.json`` (the settings, shapes and sha256 of each
file; ``tokenizer`` is ``"none"``: there are no tokens).
"""
from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .._validate import check_float, check_int
from ..utils.io import atomic_write_bytes
from .meta import FORMAT_VERSION, META_FILE
from .shakespeare import sha256_file

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class GPSettings:
    """GP regression data settings.

    Raises:
        ValueError: non-positive sizes, ``length_scale``/``variance`` ≤ 0 or ``noise`` < 0.
    """

    x_dim: int = 2
    n_points: int = 32
    length_scale: float = 0.5
    variance: float = 1.0
    noise: float = 0.1
    n_train: int = 20_000
    n_val: int = 1_000
    n_test: int = 1_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("x_dim", "n_points", "n_train", "n_val", "n_test"):
            check_int(name, getattr(self, name), 1)
        check_float("length_scale", self.length_scale, 0.0, strict=True)
        check_float("variance", self.variance, 0.0, strict=True)
        check_float("noise", self.noise, 0.0)
        check_int("seed", self.seed, 0)


def rbf_kernel(a: torch.Tensor, b: torch.Tensor, length_scale: float, variance: float) -> torch.Tensor:
    """``variance · exp(−‖a_i − b_j‖² / (2 length_scale²))``: ``(…, n, k), (…, m, k) -> (…, n, m)``."""
    sq = (a.unsqueeze(-2) - b.unsqueeze(-3)).pow(2).sum(-1)
    return variance * torch.exp(-0.5 * sq / length_scale ** 2)


def sample_sequences(n: int, s: GPSettings, generator: torch.Generator, jitter: float = 1e-8) -> torch.Tensor:
    """``n`` sequences ``(n, n_points, x_dim + 1)`` float64: inputs, then the noisy GP value."""
    x = torch.rand(n, s.n_points, s.x_dim, generator=generator, dtype=torch.float64) * 2 - 1
    cov = rbf_kernel(x, x, s.length_scale, s.variance) + jitter * torch.eye(s.n_points, dtype=torch.float64)
    z = torch.randn(n, s.n_points, 1, generator=generator, dtype=torch.float64)
    f = (torch.linalg.cholesky(cov) @ z).squeeze(-1)
    y = f + s.noise * torch.randn(n, s.n_points, generator=generator, dtype=torch.float64)
    return torch.cat([x, y.unsqueeze(-1)], dim=-1)


def generate(s: GPSettings) -> dict[str, np.ndarray]:
    """The three splits as float32 arrays ``(n_split, n_points, x_dim + 1)``."""
    gen = torch.Generator().manual_seed(s.seed)
    sizes = {"train": s.n_train, "val": s.n_val, "test": s.n_test}
    return {split: sample_sequences(sizes[split], s, gen).to(torch.float32).numpy() for split in SPLITS}


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_gp(out_dir: str | Path, s: GPSettings) -> dict:
    """Generate and write ``{train,val,test}.npy`` and ``meta.json`` (last). Returns the meta."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)
    arrays = generate(s)
    for split, arr in arrays.items():
        atomic_write_bytes(out_dir / f"{split}.npy", _npy_bytes(arr))
    meta = {"format_version": FORMAT_VERSION, "dataset": "gp", "tokenizer": "none", "vocab_size": 1,
            "n_train": s.n_train, "n_val": s.n_val, "n_test": s.n_test,
            "shape": [s.n_points, s.x_dim + 1], "settings": asdict(s),
            **{f"{split}_sha256": sha256_file(out_dir / f"{split}.npy") for split in SPLITS},
            "source": {"kind": "generator", "generator": "gp", "version": 1}}
    atomic_write_bytes(out_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return meta


def gp_up_to_date(out_dir: str | Path, s: GPSettings) -> bool:
    """Whether ``out_dir`` holds complete GP files made with the settings ``s``."""
    out_dir = Path(out_dir)
    try:
        meta = json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if meta.get("settings") != asdict(s) or meta.get("format_version") != FORMAT_VERSION:
        return False
    return all((out_dir / f"{sp}.npy").is_file() and sha256_file(out_dir / f"{sp}.npy") == meta.get(f"{sp}_sha256")
               for sp in SPLITS)


def load_gp_split(data_dir: str | Path, split: str) -> np.ndarray:
    """One split of a prepared GP directory: ``(n, n_points, x_dim + 1)`` float32.

    Raises:
        ValueError: ``split`` not one of train/val/test.
        FileNotFoundError: the file is missing (run ``energyformer prepare gp``).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not valid; expected one of {SPLITS}")
    path = Path(data_dir) / f"{split}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `energyformer prepare gp` first")
    return np.load(path, allow_pickle=False)


def describe(meta: dict) -> str:
    """One line for the prepare command's output."""
    st = meta["settings"]
    return (f"{meta['n_train']:,} train / {meta['n_val']:,} val / {meta['n_test']:,} test sequences of "
            f"{st['n_points']} points, x_dim {st['x_dim']}, length_scale {st['length_scale']}, noise {st['noise']}")
