"""Forming an execution group + its first collective: group-free (ours) vs torch.distributed.new_group.

Three processes share one gloo world (set up once, not timed). Ranks 0 and 1 form a group and
all-gather a [4, 1024] float tensor in it; rank 2 is not a member. Ours: Group.of((0, 1)) is a
local descriptor, the all-gather runs over tagged point-to-point sends, rank 2 does nothing.
new_group: every rank of the world must enter new_group (rank 2 too: that is its stall), then
the members all-gather in the new communicator. Both measured in the same run, --repeats times
each, interleaved; reports medians.

    python benchmarks/bench_groups.py
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _worker(rank: int, port: int, repeats: int, out: mp.Queue) -> None:
    from batchgen.diffusion.parallel.groups import Group, all_gather, init_world

    torch.set_num_threads(1)
    init_world(rank, 3, f"tcp://127.0.0.1:{port}")
    x = torch.full((4, 1024), float(rank))
    ours, theirs, stall, again_ours, again_theirs = [], [], [], [], []
    for rep in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank < 2:
            g = Group.of((0, 1), salt=str(rep))
            got = all_gather(g, x, [tuple(x.shape)] * 2)
            assert float(got[1 - rank][0, 0]) == 1 - rank
        ours.append(time.perf_counter() - t0)
        if rank < 2:
            t1 = time.perf_counter()
            all_gather(g, x, [tuple(x.shape)] * 2)
            again_ours.append(time.perf_counter() - t1)
        dist.barrier()
        t0 = time.perf_counter()
        pg = dist.new_group([0, 1])  # collective over the whole world: rank 2 must enter too
        t_formed = time.perf_counter() - t0
        if rank < 2:
            bufs = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(bufs, x, group=pg)
        theirs.append(time.perf_counter() - t0)
        if rank < 2:
            t1 = time.perf_counter()
            dist.all_gather(bufs, x, group=pg)
            again_theirs.append(time.perf_counter() - t1)
        stall.append(t_formed)
    out.put((rank, ours, theirs, stall, again_ours, again_theirs))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.repeats, q)) for r in range(3)]
    for p in procs:
        p.start()
    res = {r[0]: r[1:] for r in (q.get() for _ in procs)}
    for p in procs:
        p.join()
    med = statistics.median
    ours = med(max(res[0][0][i], res[1][0][i]) for i in range(args.repeats))
    theirs = med(max(res[0][1][i], res[1][1][i]) for i in range(args.repeats))
    stall = med(res[2][2])
    print(f"group of ranks (0, 1) in a world of 3, gloo on CPU, median of {args.repeats}:")
    print(f"  form + first all-gather, ours (descriptor + tagged p2p): {ours * 1e6:8.0f} us")
    print(f"  form + first all-gather, new_group:                      {theirs * 1e6:8.0f} us  ({theirs / ours:.1f}x ours)")
    print(f"  a second all-gather in the formed group: ours {med(res[0][3]) * 1e6:.0f} us, "
          f"new_group {med(res[0][4]) * 1e6:.0f} us (rank 0)")
    print(f"  non-member (rank 2) stall: ours 0 us (not involved), new_group {stall * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
