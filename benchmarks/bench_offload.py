"""Memory-constrained MoE: experts on disk with a quarter of them in memory, against Hugging Face
accelerate's big-model offload and against batchgen with every expert resident.

The model is bench_engine's Mixtral-style demo MoE (fp32) and the workload its heavy-tailed one.
Memory budget: the non-expert weights plus 25% of the routed experts.
  (a) accelerate as users write it: `from_pretrained(device_map="auto", max_memory={"cpu": budget},
      offload_folder=...)`, then batched `generate` (bench_engine's transformers side: fixed
      batches, left padding). Whole decoder layers beyond the budget live in the offload folder
      and every forward reads them again; bytes per token are counted from its device map and
      the forwards its hooks ran.
  (b) batchgen with every expert resident.
  (c) batchgen with `expert_host_memory_bytes` = 25% of the experts: the rest stay in the
      checkpoint's safetensors file and are read per expert (bytes counted by the store).
By default both files sit in the OS page cache after the first touch, so a "disk" read costs a
memory copy, for (a) and (c) alike. --cold-disk drops every expert batchgen reads from the page
cache again (posix_fadvise DONTNEED), so its reads reach the disk, as for a model larger than
memory; accelerate's offload folder stays cached, a bound in accelerate's favour.
Reports tokens/s, expert bytes read per generated token and hit rates; ratios are same-run.

    python benchmarks/bench_offload.py [--rows 256] [--batch 16] [--skip-accelerate] [--cold-disk] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from bench_engine import generate_in_batches, run_batchgen, workload

from batchgen import Engine
from batchgen.models.weights import MoEWeights
from batchgen.offload.disk import DiskExperts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the checkpoint builders
from demo_builder import build_demo_model  # noqa: E402


def expert_bytes(model_dir: Path) -> tuple[int, int]:
    """(routed expert bytes, all weight bytes) of the checkpoint in the engine's fp32."""
    engine = Engine(model_dir, dtype="float32", kv_cache_bytes=1 << 20)
    experts = sum(_expert_numel(l.ffn) for l in engine.model.weights.layers if isinstance(l.ffn, MoEWeights)) * 4
    total = sum(p.numel() * p.element_size() for p in _tensors(engine.model.weights))
    return experts, total


def _expert_numel(ffn: MoEWeights) -> int:
    if ffn.tiles is not None:  # resident fp32 experts on the CPU, tiled at load
        return ffn.tiles.w13.numel() + ffn.tiles.w2.numel()
    assert ffn.w13 is not None and ffn.w2 is not None
    return ffn.w13.numel() + ffn.w2.numel()


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list):
        return [t for x in obj for t in _tensors(x)]
    if hasattr(obj, "__dataclass_fields__"):
        seen: dict[int, torch.Tensor] = {}
        for name in obj.__dataclass_fields__:
            for t in _tensors(getattr(obj, name)):
                seen[id(t)] = t
        return list(seen.values())
    return []


def run_accelerate(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int,
                   budget: int) -> tuple[float, int, int]:
    """-> (seconds, bytes its offload hooks read, forwards)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as offload:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="auto",
                                                     max_memory={"cpu": budget}, offload_folder=offload).eval()
        on_disk = {name for name, where in model.hf_device_map.items() if where == "disk"}
        offloaded = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                        if any(name == m or name.startswith(m + ".") for m in on_disk))
        forwards = 0

        def count(*_: object) -> None:
            nonlocal forwards
            forwards += 1
        model.register_forward_pre_hook(count)
        elapsed = generate_in_batches(model, prompts, lengths, batch)
    print(f"  accelerate device map: {len(on_disk)} modules in the offload folder, "
          f"{offloaded / 2**20:.1f} MiB read per forward")
    return elapsed, offloaded * forwards, forwards


def cold_disk_reads() -> None:
    """Benchmark instrumentation: after each expert read, tell the OS to drop those pages, so
    the next read of that expert comes from the disk, not from memory."""
    read = DiskExperts.read

    def cold(self: DiskExperts, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        nbytes = read(self, layer, expert, w13, w2)
        for p in self.pieces[(layer, expert)]:
            os.posix_fadvise(self._fds[p.file], p.offset, p.nbytes, os.POSIX_FADV_DONTNEED)
        return nbytes
    DiskExperts.read = cold  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="accelerate/transformers batch size")
    ap.add_argument("--resident-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every side")
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--cold-disk", action="store_true", help="drop each expert from the OS page cache after "
                    "batchgen reads it (posix_fadvise DONTNEED), so every read reaches the disk, as for a model "
                    "larger than memory; accelerate's side is left as it is")
    ap.add_argument("--sweep", action="store_true", help="also: tiered engine over attention micro-batch "
                    "bounds and eviction/prefetch policies")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)  # as bench_engine: random weights make denormals on the HF side
    torch.set_num_threads(args.threads)
    if args.cold_disk:
        cold_disk_reads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "demo", dtype="float32")
        prompts, lengths = workload(args.rows, 1000, args.seed)
        tokens = sum(lengths)
        experts, total = expert_bytes(model_dir)
        host_budget = int(experts * args.resident_fraction)
        print(f"model: {total / 2**20:.1f} MiB of weights, {experts / 2**20:.1f} MiB routed experts; "
              f"expert budget {host_budget / 2**20:.1f} MiB ({args.resident_fraction:.0%}); "
              f"{args.rows} rows, {tokens} output tokens, threads {args.threads}")
        t_res, _, want = run_batchgen(model_dir, prompts, lengths)
        t_off, st, got = run_batchgen(model_dir, prompts, lengths, expert_host_memory_bytes=host_budget)
        assert got == want, "tiered engine's tokens differ from the resident engine's"
        per_token = st["expert_bytes_from_disk"] + st["expert_bytes_from_host"]
        print(f"(b) batchgen, every expert resident:  {tokens / t_res:8.1f} tok/s")
        print(f"(c) batchgen, experts on disk, {args.resident_fraction:.0%} in memory: {tokens / t_off:8.1f} tok/s "
              f"= {t_res / t_off:.2f}x of (b); {per_token / 2**20:.3f} MiB expert reads per token; "
              f"hit rate {st['expert_hit_rate_device']:.1%}; prefetch accuracy {st['expert_prefetch_accuracy']:.1%}; "
              f"waiting for experts {st['expert_fetch_wait_fraction']:.1%} of engine time; "
              f"MoE batch mean {st['moe_batch_mean']:.1f} tokens")
        if not args.skip_accelerate:
            t_acc, acc_bytes, forwards = run_accelerate(model_dir, prompts, lengths, args.batch,
                                                        total - experts + host_budget)
            acc_per_token = acc_bytes / tokens
            print(f"(a) accelerate offload, batches of {args.batch}: {tokens / t_acc:8.1f} tok/s; "
                  f"{acc_per_token / 2**20:.3f} MiB read per token ({forwards} forwards)")
            print(f"batchgen (c) vs accelerate (a): {t_acc / t_off:.2f}x tokens/s, "
                  f"{acc_per_token / max(per_token, 1):.1f}x fewer bytes per token")
        if args.sweep:
            for kv in (1 << 30, 256, 1024, 4096):  # 1 << 30: one attention batch
                for eviction, prefetch, overlap in (("routing", "none", True), ("routing", "none", False),
                                                    ("routing", "router", True), ("layer-order", "none", True)):
                    t, s, _ = run_batchgen(model_dir, prompts, lengths, expert_host_memory_bytes=host_budget,
                                           attention_kv_tokens=kv, expert_eviction=eviction, expert_prefetch=prefetch,
                                           expert_overlap_reads=overlap)
                    print(f"  sweep kv={kv} {eviction}/{prefetch}/overlap={overlap}: {t_res / t:.2f}x of (b), "
                          f"{s['expert_bytes_from_disk'] / 2**20:.3f} MiB/token, "
                          f"prefetch accuracy {s['expert_prefetch_accuracy']:.1%}")


if __name__ == "__main__":
    main()
