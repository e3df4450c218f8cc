"""restore_heap_reuse raises glibc's thresholds once per process, so large freed blocks are reused."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

needs_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt")
PROBE = "from batchgen.malloc import restore_heap_reuse as r; print(r(), r())"


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


@needs_glibc
@pytest.mark.parametrize("env", [{}, {"MALLOC_TRIM_THRESHOLD_": "65536"}], ids=["glibc-defaults", "dask-pinned"])
def test_thresholds_are_raised_once_per_process(env: dict[str, str]) -> None:
    assert probe(**env) == "True False"  # changed, then already done


# rounds of six 8 MiB activations allocated, touched and freed, as a forward's stages do; prints
# the minor page faults each round took
ROUNDS = """
import resource, sys, torch
from batchgen.malloc import restore_heap_reuse
if sys.argv[1] == "restore":
    restore_heap_reuse()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(2 << 20).fill_(1.0) for _ in range(6)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@needs_glibc
def test_freed_activations_are_reused_instead_of_faulted_in_again() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env = {**clean, "MALLOC_TRIM_THRESHOLD_": "65536"}  # as Dask's nanny starts workers

    def faults(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", ROUNDS, mode], env=env, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        return [int(v) for v in out.split()]

    # counted relative to each other, not in 4 KiB pages: with THP `always` a fault maps 2 MiB
    keep, restore = faults("keep")[4:], faults("restore")[4:]
    assert min(keep) > 0  # every round maps its blocks afresh
    assert 4 * sum(restore) < sum(keep)  # the heap hands the same pages back


@needs_glibc
def test_a_diffusion_engine_restores_heap_reuse_unless_told_not_to(tmp_path) -> None:
    pytest.importorskip("diffusers")
    import tiny_diffusion as tiny

    path = tiny.build_dit(tmp_path / "dit")
    code = ("import batchgen.malloc as m; from batchgen.diffusion import DiffusionEngine as E; "
            f"E({str(path)!r}, restore_heap_reuse=False); a = m._done.is_set(); E({str(path)!r}); "
            "print(a, m._done.is_set(), m.restore_heap_reuse())")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "MALLOC_TRIM_THRESHOLD_": "65536"},
                         capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert out.splitlines()[-1] == "False True False"  # untouched, then set by the engine (once)
