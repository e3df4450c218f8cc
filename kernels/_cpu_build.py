"""Builds the CPU kernels in csrc/ (one library per .cpp file, with the headers in csrc/NAME/ that
it includes) once per machine and source, and loads them with ctypes.

The library is plain C++ (no torch headers, no pybind, no ninja): one compiler call of a second or
a few, cached under $BATCHGEN_KERNEL_CACHE (default ~/.cache/batchgen/kernels) by a hash of the
sources, the compiler, its flags and the CPU's feature flags (-march=native), so a shared home
over different CPUs never loads a library built for another. OpenMP comes from the libgomp torch
has already loaded, so the kernel shares torch's thread pool. Any failure (no compiler, a failed
build, a library that will not load) is remembered and reported by `cpu_kernels_error()`; the
callers fall back to torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_CSRC = Path(__file__).resolve().parent / "csrc"
# library -> flags of its own: the rope and RMSNorm kernels must round every fp32 product as torch does
_LIBRARIES = {"paged_attention_cpu": [], "rope_kv_cpu": ["-ffp-contract=off"], "rms_norm_cpu": ["-ffp-contract=off"],
              "router_cpu": [], "small_rows_cpu": []}
# AVX2 + FMA where the CPU has them: measured ~10% faster than -march=native's AVX-512 on the
# decode shapes here (dk 32-128); then native, then portable; OpenMP threads, else SIMD only.
_FLAG_SETS = (["-O3", "-march=x86-64-v3", "-fopenmp"], ["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"],
              ["-O3", "-fopenmp-simd"])
# The CPU features each -march level needs (it is skipped where the CPU lacks one).
_LEVEL_FEATURES = {"-march=x86-64-v3": ("avx2", "fma", "bmi2", "movbe"),
                   "-march=x86-64-v4": ("avx2", "fma", "bmi2", "movbe", "avx512f", "avx512bw", "avx512cd",
                                        "avx512dq", "avx512vl")}
# Flag sets a library tries before _FLAG_SETS: the small-row kernels' expert tiles take sixteen
# lanes with AVX-512 (csrc/small_rows_cpu/fp32_tiles.h, TileShape), 1.02-1.14x the eight-lane
# ones; the rest of that library measured level in either build.
_FIRST_FLAG_SETS = {"small_rows_cpu": (["-O3", "-march=x86-64-v4", "-fopenmp"],)}
_BASE_FLAGS = ["-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]
BUILD_TIMEOUT_S = 180

_state: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}  # library -> (loaded, why not); on first use


def cache_dir() -> Path:
    env = os.environ.get("BATCHGEN_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen" / "kernels"


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them in /proc/cpuinfo ("avx2", "avx512_bf16",
    "amx_bf16", ...); empty where there is no such file."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


@functools.cache  # (read once: callers ask per weight while a model loads)
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_sources(name: str) -> list[Path]:
    """The files library `name` is built from: csrc/NAME.cpp, then its headers (csrc/NAME/*.h,
    sorted), then the headers every library may include (csrc/common/*.h, sorted); a change to any
    of them gives the library a new cache key."""
    return [_CSRC / f"{name}.cpp", *sorted((_CSRC / name).glob("*.h")), *sorted((_CSRC / "common").glob("*.h"))]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cxx: str, source: Path, flags: list[str], target: Path) -> str | None:
    """-> None when `target` was built, else the compiler's complaint."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # concurrent builders never share a file
        os.close(fd)
    except OSError as exc:
        return f"cannot write the kernel cache {target.parent}: {exc}"
    try:
        done = subprocess.run([cxx, *_BASE_FLAGS, *flags, str(source), "-o", tmp], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            return done.stderr.strip()[-400:] or f"exit status {done.returncode}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    import torch  # noqa: F401  (its libgomp must be loaded first, so the kernel shares it)

    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX, or install g++)"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        path = _CSRC / f"{name}.cpp"
        source = b"\0".join(f.name.encode() + b"\0" + f.read_bytes() for f in library_sources(name))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot run {cxx} or read {name}.cpp: {exc}"
    errors = []
    cpu = _cpu_flags()
    features = cpu_features()
    for flags in (f + _LIBRARIES[name] for f in (*_FIRST_FLAG_SETS.get(name, ()), *_FLAG_SETS)):
        level = next((f for f in flags if f in _LEVEL_FEATURES), None)
        if level is not None and not set(_LEVEL_FEATURES[level]) <= features:
            continue
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(_BASE_FLAGS + flags).encode(),
                                         cpu.encode()])).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        if not target.exists():
            err = _build(cxx, path, flags, target)
            if err is not None:
                errors.append(f"{' '.join(flags)}: {err}")
                continue
        try:
            lib = ctypes.CDLL(str(target))
            if lib.batchgen_abi_version() != 1:
                raise OSError("ABI version mismatch")
        except OSError as exc:
            errors.append(f"{target}: {exc}")
            continue
        _declare(lib)
        return lib, None
    return None, "building the CPU kernels failed: " + " | ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    if hasattr(lib, "batchgen_paged_decode"):
        fn = lib.batchgen_paged_decode
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    if hasattr(lib, "batchgen_rms_norm"):
        fn = lib.batchgen_rms_norm
        fn.restype = None
        fn.argtypes = [i32, ptr, i64, ptr, ptr, i64, i32, ctypes.c_float, i32]
    if hasattr(lib, "batchgen_route"):
        fn = lib.batchgen_route
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32, i32, ctypes.c_float, ctypes.c_float, ptr, ptr]
    if hasattr(lib, "batchgen_rope_kv_write"):
        fn = lib.batchgen_rope_kv_write
        fn.restype = i64
        fn.argtypes = [i32, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, i32, i32, i32]
    if hasattr(lib, "batchgen_moe_small_rows"):
        fn = lib.batchgen_moe_small_rows
        fn.restype = i32
        fn.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32]
    if hasattr(lib, "batchgen_moe_routed_small_rows"):
        fn = lib.batchgen_moe_routed_small_rows
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr]
    if hasattr(lib, "batchgen_moe_routed_tiled"):
        fn = lib.batchgen_moe_routed_tiled
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr]
    if hasattr(lib, "batchgen_moe_routed_bf16"):
        fn = lib.batchgen_moe_routed_bf16
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, i32, ptr, ptr, ptr, ptr, i32, i32, i32, ptr]
    if hasattr(lib, "batchgen_linear_bf16"):
        fn = lib.batchgen_linear_bf16
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32]
    if hasattr(lib, "batchgen_bf16_experts_supported"):
        lib.batchgen_bf16_experts_supported.restype = i32
        lib.batchgen_bf16_experts_supported.argtypes = []
    if hasattr(lib, "batchgen_linear_tiled"):
        fn = lib.batchgen_linear_tiled
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32]
    if hasattr(lib, "batchgen_silu_times"):
        lib.batchgen_silu_times.restype = None
        lib.batchgen_silu_times.argtypes = [i32, ptr, ptr, ptr]
    if hasattr(lib, "batchgen_tile_lanes"):
        lib.batchgen_tile_lanes.restype = i32
        lib.batchgen_tile_lanes.argtypes = []
    if hasattr(lib, "batchgen_linear_small_rows"):
        fn = lib.batchgen_linear_small_rows
        fn.restype = i32
        fn.argtypes = [i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32]


def cpu_kernels(name: str = "paged_attention_cpu") -> ctypes.CDLL | None:
    """Library `name` (csrc/NAME.cpp), built on first call; None where it cannot be (see
    cpu_kernels_error). BATCHGEN_CPU_KERNELS=0 turns them off (the torch paths run instead)."""
    if os.environ.get("BATCHGEN_CPU_KERNELS", "1") == "0":
        return None
    if name not in _state:
        _state[name] = _load(name)
        if _state[name][1] is not None:
            logging.getLogger("batchgen_kernels").warning("%s: using the torch path: %s", name, _state[name][1])
    return _state[name][0]


def cpu_kernels_error(name: str = "paged_attention_cpu") -> str | None:
    """Why `cpu_kernels(name)` is None (after a first call), else None."""
    if os.environ.get("BATCHGEN_CPU_KERNELS", "1") == "0":
        return "turned off by BATCHGEN_CPU_KERNELS=0"
    return _state[name][1] if name in _state else None
