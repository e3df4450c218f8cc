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
