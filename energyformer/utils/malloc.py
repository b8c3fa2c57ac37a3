"""Keep freed CPU tensor memory in the process (glibc ``malloc`` settings; docs/cli.md, "CPU memory").

With glibc's defaults, a training step on the CPU gives much of the memory it frees back to the
operating system (the heap is trimmed above a threshold that adapts to the largest recent
``mmap``), and the next step takes it back page by page: thousands of page faults per step, each
page zeroed by the kernel. The CEM recursion allocates per step, so it pays this once per inner
step: on 2 cores, a tied T = 4 CEM layer at (d 128, N 128, B 32) took 5,000–20,000 minor page
faults per forward + backward and 2–6% of its time in the kernel (``benchmarks/README.md``).

:func:`keep_freed_memory` sets three ``mallopt`` parameters once per process: a fixed
``M_MMAP_THRESHOLD`` of 32 MiB (glibc's largest; larger blocks are still mapped and unmapped),
``M_TRIM_THRESHOLD`` 1 GiB and ``M_TOP_PAD`` 256 MiB, so the freed memory stays in the heap and
is reused. The cost: the process keeps up to about 1 GiB of freed memory instead of returning it
(its resident size stays near its peak). Every command that trains or runs a model calls it
(:func:`energyformer.utils.device.configure_backends`); ``ENERGYFORMER_MALLOC=system`` in the
environment leaves the allocator as it is. Elsewhere than Linux with glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["ENV", "keep_freed_memory", "SETTINGS"]

#: the environment variable: ``tuned`` (the default) or ``system`` (glibc's own settings)
ENV = "ENERGYFORMER_MALLOC"
_CHOICES = ("tuned", "system")

# mallopt parameter numbers (glibc's <malloc.h>) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: ``(name, mallopt parameter, value in bytes)``
SETTINGS = (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, 32 << 20),
            ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, 1 << 30),
            ("M_TOP_PAD", M_TOP_PAD, 256 << 20))

_applied: bool | None = None  # the outcome in this process (set once)


def _mallopt():
    """glibc's ``mallopt`` of this process, or None (not Linux with glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(None), "mallopt", None)


def keep_freed_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed memory in the process (see the module docstring), once
    per process. Returns whether the settings are in effect.

    Raises:
        ValueError: ``ENERGYFORMER_MALLOC`` set to something other than ``tuned`` or ``system``.
    """
    global _applied
    choice = os.environ.get(ENV, "tuned").strip().lower() or "tuned"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} must be one of {', '.join(_CHOICES)} "
                         "(tuned: keep freed CPU memory in the process; system: glibc's own settings)")
    if _applied is not None:
        return _applied
    if choice == "system":
        _applied = False
        return False
    mallopt = _mallopt()
    if mallopt is None:
        _applied = False
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for _, param, value in SETTINGS)
    return _applied
