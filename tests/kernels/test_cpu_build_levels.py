"""The CPU kernels' builds follow the CPU's features: the small-row library takes AVX-512 (and its
sixteen-lane expert tiles) only where the CPU has every feature x86-64-v4 needs."""
from __future__ import annotations

import pytest

from batchgen_kernels import _cpu_build, cpu_small_rows

pytestmark = pytest.mark.skipif(not cpu_small_rows.cpu_small_rows_available(),
                                reason="the CPU small-row kernels do not build here")
V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


def test_a_cpu_without_avx512_gets_eight_lane_tiles(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    real = _cpu_build._cpu_flags()
    if not {"avx2", "fma", "bmi2", "movbe"} <= set(real.split()):
        pytest.skip("this CPU lacks x86-64-v3")
    monkeypatch.setenv("BATCHGEN_KERNEL_CACHE", str(tmp_path))
    without = " ".join(f for f in real.split() if not f.startswith("avx512"))
    monkeypatch.setattr(_cpu_build, "_cpu_flags", lambda: without)
    built: list[list[str]] = []
    build = _cpu_build._build
    monkeypatch.setattr(_cpu_build, "_build", lambda cxx, source, flags, target: built.append(flags)
                        or build(cxx, source, flags, target))
    lib, why = _cpu_build._load("small_rows_cpu")
    assert why is None and lib.batchgen_tile_lanes() == 8
    assert built and all("-march=x86-64-v4" not in flags for flags in built)  # (never even tried)
    if set(V4) <= set(real.split()):  # one missing feature is enough to keep AVX2
        monkeypatch.setattr(_cpu_build, "_cpu_flags", lambda: real.replace(" avx512cd", ""))
        lib, why = _cpu_build._load("small_rows_cpu")
        assert why is None and lib.batchgen_tile_lanes() == 8


def test_a_cpu_with_avx512_gets_sixteen_lane_tiles() -> None:
    if not set(V4) <= set(_cpu_build._cpu_flags().split()):
        pytest.skip("this CPU lacks AVX-512")
    assert cpu_small_rows.small_rows_library().batchgen_tile_lanes() == 16


def test_a_change_to_a_header_rebuilds_the_library(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A library's cache key covers csrc/NAME/*.h and csrc/common/*.h, not only NAME.cpp: an
    edited header is never served the library built from the old one."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe.cpp").write_text('#include "probe/value.h"\n'
                                        'extern "C" int batchgen_abi_version() { return 1; }\n'
                                        'extern "C" int probe_value() { return VALUE; }\n')
    monkeypatch.setattr(_cpu_build, "_CSRC", tmp_path)
    monkeypatch.setitem(_cpu_build._LIBRARIES, "probe", [])
    monkeypatch.setenv("BATCHGEN_KERNEL_CACHE", str(tmp_path / "cache"))
    assert _cpu_build.library_sources("probe") == [tmp_path / "probe.cpp"]
    values = []
    for value in (1, 2):
        (tmp_path / "probe" / "value.h").write_text(f"#define VALUE {value}\n")
        lib, why = _cpu_build._load("probe")
        assert why is None
        values.append(lib.probe_value())
    assert values == [1, 2]
    assert _cpu_build.library_sources("probe") == [tmp_path / "probe.cpp", tmp_path / "probe" / "value.h"]
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 2
    # the headers every library may include (csrc/common) are in every library's key
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "shared.h").write_text("#define SHARED 1\n")
    assert _cpu_build.library_sources("probe")[-1] == tmp_path / "common" / "shared.h"
    assert _cpu_build._load("probe")[1] is None
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 3
