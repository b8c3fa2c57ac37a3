"""energyformer/utils/malloc.py: glibc keeps freed CPU memory in the process (docs/cli.md, "CPU memory").

The behaviour is measured in fresh interpreters (the settings are process-wide and set once): with
the settings, a second round of the same allocations takes (almost) no new page faults; with
``ENERGYFORMER_MALLOC=system`` it takes them again, as glibc's own trimming gives the memory back.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from energyformer.utils import malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# allocate and free 40 blocks of 4 MiB (touched), twice; report the second round's minor faults
_PROBE = r"""
import json, resource, sys
import torch
from energyformer.utils.device import configure_backends
configure_backends("cpu")
from energyformer.utils import malloc
def round_():
    blocks = [torch.ones(1 << 20) for _ in range(40)]   # 4 MiB each, below the 32 MiB mmap threshold
    del blocks
round_()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0,
                  "applied": malloc.keep_freed_memory()}))
"""


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != malloc.ENV}
    if env_value is not None:
        env[malloc.ENV] = env_value
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc settings (Linux only)")
def test_freed_memory_is_reused_not_faulted_back():
    tuned, system = _probe(None), _probe("system")
    assert tuned["applied"] is True and system["applied"] is False
    # 40 × 4 MiB = 40,960 pages of 4 KiB: glibc's own trimming faults (nearly) all of them back in
    # round 2; tuned, 1,024-7,168 here (a few blocks), so at least 4× fewer
    assert system["faults"] > 30_000 and tuned["faults"] < system["faults"] / 4, (tuned, system)


def test_an_unknown_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(malloc.ENV, "fast")
    with pytest.raises(ValueError, match=r"ENERGYFORMER_MALLOC='fast' must be one of tuned, system"):
        malloc.keep_freed_memory()


def test_system_and_non_glibc_leave_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setenv(malloc.ENV, "system")
    monkeypatch.setattr(malloc, "_mallopt", lambda: pytest.fail("mallopt called with ENERGYFORMER_MALLOC=system"))
    assert malloc.keep_freed_memory() is False
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.delenv(malloc.ENV)
    monkeypatch.setattr(malloc, "_mallopt", lambda: None)  # not Linux with glibc
    assert malloc.keep_freed_memory() is False


def test_settings_are_applied_once(monkeypatch):
    calls = []

    def fake_mallopt(param, value):
        calls.append((param, value))
        return 1

    fake_mallopt.argtypes = fake_mallopt.restype = None
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.delenv(malloc.ENV, raising=False)
    monkeypatch.setattr(malloc, "_mallopt", lambda: fake_mallopt)
    assert malloc.keep_freed_memory() is True and malloc.keep_freed_memory() is True
    assert calls == [(param, value) for _, param, value in malloc.SETTINGS]
