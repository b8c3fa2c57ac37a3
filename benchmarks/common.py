"""What every benchmark script shares: the environment record and the JSON results file."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def environment(device: str) -> dict[str, Any]:
    """torch and Python versions, machine, threads and device of this run."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "device": device}


def write_results(path: str | Path, device: str, settings: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    """Write ``{"env", "settings", "rows"}`` as JSON to ``path`` (parents created) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": environment(device), "settings": settings, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
