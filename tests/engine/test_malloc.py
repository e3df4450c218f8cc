"""restore_heap_reuse acts only where Dask-style malloc variables pinned glibc's thresholds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from batchgen.malloc import restore_heap_reuse as r; print(r(), r())"


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_thresholds_are_raised_once_where_dask_pinned_them() -> None:
    assert probe(MALLOC_TRIM_THRESHOLD_="65536") == "True False"  # changed, then already done


def test_nothing_changes_where_glibc_keeps_its_dynamic_thresholds() -> None:
    assert probe() == "False False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
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
