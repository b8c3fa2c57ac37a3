"""Device names → ``torch.device``, checked against what this machine has."""
from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA if available, else CPU; checks that an explicit CUDA/MPS device exists.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``.

    Raises:
        ValueError: not a device name, or the requested accelerator is not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; expected 'auto', 'cpu', 'cuda', 'cuda:N' "
                         "or 'mps'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available; use device 'cpu'")
    return dev
