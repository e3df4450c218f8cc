"""The disk tier: routed experts read one at a time from the checkpoint's own safetensors files.

Nothing is loaded whole or converted: at start only the files' JSON headers are read (where each
tensor's bytes lie); an expert's bytes are then read with os.pread into the slot that will hold
it. Why pread and not mmap: a memory-mapped file that is truncated under us raises SIGBUS on
the next touch, which kills the process (Python cannot catch it); pread just returns short and
the rows that needed the expert fail with an error. pread also releases the GIL, so the
prefetch thread reads while the compute thread runs. The files stay open for the engine's
life, so one deleted mid-job keeps being read from its open descriptor (Linux keeps the data).

Two layouts, as models/loader.py: per-expert tensors (`experts.{e}.{gate,up,down}.weight`) and
fused stacks (`experts.gate_up_proj` [E, 2N, H], `experts.down_proj` [E, H, N]), where expert e
is the e-th contiguous slice.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError

# safetensors dtype codes -> torch dtypes
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class ExpertReadError(RuntimeError):
    """An expert's bytes could not be read from the checkpoint (file truncated, I/O error)."""


@dataclass(frozen=True, slots=True)
class TensorLocation:
    file: Path
    dtype: str  # safetensors' code ("BF16", "F32", ...); only expert tensors must be floats
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int

    def torch_dtype(self, name: str) -> torch.dtype:
        if self.dtype not in ST_DTYPES:
            raise ModelLoadError(f"{self.file.name}: expert tensor {name!r} has dtype {self.dtype!r}; "
                                 f"expert offload reads {sorted(ST_DTYPES)}")
        return ST_DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous run of one expert's bytes: rows [row0, row0 + rows) of w13 or w2."""

    file: Path
    dtype: torch.dtype
    offset: int
    nbytes: int
    target: str  # "w13" or "w2"
    row0: int
    rows: int


def read_header(path: Path) -> dict[str, TensorLocation]:
    """A safetensors file's tensor index (8-byte little-endian header length, JSON header)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {path.name}: {exc}") from exc
    base = 8 + length
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > size:
            raise ModelLoadError(f"{path.name} is truncated: tensor {name!r} ends at byte {base + end}, "
                                 f"the file has {size}")
        out[name] = TensorLocation(path, info.get("dtype"), tuple(info["shape"]), base + start, end - start)
    return out


class DiskExperts:
    """Where each (layer, expert) lies in the checkpoint, and a reader into given tensors."""

    def __init__(self, model_dir: Path, layer_prefixes: dict[int, str], num_experts: dict[int, int],
                 names: tuple[str, str, str], w13_shape: tuple[int, int], w2_shape: tuple[int, int]) -> None:
        """layer_prefixes: MoE layer -> its ffn prefix (`model.layers.3.mlp`); names: the
        per-expert (gate, up, down) tensor names; w13_shape [2N, H], w2_shape [H, N]."""
        index: dict[str, TensorLocation] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            index.update(read_header(f))
        self.w13_shape, self.w2_shape = w13_shape, w2_shape
        self.pieces: dict[tuple[int, int], list[Piece]] = {}
        for layer, prefix in layer_prefixes.items():
            for e in range(num_experts[layer]):
                self.pieces[(layer, e)] = self._locate(index, prefix, e, names)
        self._fds: dict[Path, int] = {}
        for path in {p.file for pieces in self.pieces.values() for p in pieces}:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                self.close()
                raise ModelLoadError(f"cannot open weights file {path.name}: {exc}") from exc

    def _locate(self, index: dict[str, TensorLocation], prefix: str, e: int, names: tuple[str, str, str]) -> list[Piece]:
        n2, h = self.w13_shape
        fused13, fused2 = index.get(f"{prefix}.experts.gate_up_proj"), index.get(f"{prefix}.experts.down_proj")
        if fused13 is not None and fused2 is not None:
            out = []
            for loc, target, shape in ((fused13, "w13", self.w13_shape), (fused2, "w2", self.w2_shape)):
                if tuple(loc.shape[1:]) != shape:
                    raise ModelLoadError(f"{prefix}.experts: {target} has shape {loc.shape}, expected [E, {shape}]")
                per = loc.nbytes // loc.shape[0]
                dtype = loc.torch_dtype(f"{prefix}.experts.{target}")
                out.append(Piece(loc.file, dtype, loc.offset + e * per, per, target, 0, shape[0]))
            return out
        g, u, d = names
        out = []
        for name, target, row0, shape in ((g, "w13", 0, (n2 // 2, h)), (u, "w13", n2 // 2, (n2 // 2, h)),
                                          (d, "w2", 0, self.w2_shape)):
            key = f"{prefix}.experts.{e}.{name}.weight"
            loc = index.get(key)
            if loc is None:
                raise ModelLoadError(f"weights lack tensor {key!r}")
            if loc.shape != shape:
                raise ModelLoadError(f"{key} has shape {list(loc.shape)}, config.json says {list(shape)}")
            out.append(Piece(loc.file, loc.torch_dtype(key), loc.offset, loc.nbytes, target, row0, shape[0]))
        return out

    def read(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Read one expert into w13 [2N, H] and w2 [H, N] (contiguous CPU tensors of the engine's
        dtype); -> bytes read from disk. Raises ExpertReadError naming the file."""
        total = 0
        for p in self.pieces[(layer, expert)]:
            dst = (w13 if p.target == "w13" else w2)[p.row0:p.row0 + p.rows]
            same = p.dtype == dst.dtype
            buf = dst if same else torch.empty(dst.shape, dtype=p.dtype)
            view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
            got = 0
            while got < p.nbytes:  # reads may come back short (large pieces, network filesystems)
                try:
                    n = os.preadv(self._fds[p.file], [view[got:]], p.offset + got)
                except OSError as exc:
                    raise ExpertReadError(f"reading expert {expert} of layer {layer} from {p.file.name} "
                                          f"failed: {exc}") from exc
                if n == 0:  # end of file
                    break
                got += n
            if got != p.nbytes:
                raise ExpertReadError(f"weights file {p.file.name} is truncated: expert {expert} of layer {layer} "
                                      f"needs bytes {p.offset}..{p.offset + p.nbytes}, read {got}")
            if not same:
                dst.copy_(buf)
            total += p.nbytes
        return total

    def advise(self, layer: int, expert: int) -> None:
        """Ask the OS to start reading an expert into its page cache (no memory budget of ours
        is used; a later read() then finds it there). Used for predicted experts no slot is
        free for. A no-op where posix_fadvise is missing."""
        fadvise = getattr(os, "posix_fadvise", None)
        if fadvise is None:
            return
        for p in self.pieces[(layer, expert)]:
            try:
                fadvise(self._fds[p.file], p.offset, p.nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                return  # advice only

    def close(self) -> None:
        for fd in getattr(self, "_fds", {}).values():  # __init__ may have failed before opening any
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}

    def __del__(self) -> None:
        self.close()
