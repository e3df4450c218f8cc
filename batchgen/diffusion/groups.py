"""Group-free collectives: one world communicator (torch.distributed, gloo) set up once; a group is
a local descriptor (ordered ranks, hashed id) and its collectives run over point-to-point sends
tagged with (group id, sequence number). Forming a group talks to nobody; ranks outside it never
take part (torch.distributed.new_group, by contrast, must be entered by every rank of the world).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_TAG_SPACE = 2**31 - 1


def init_world(rank: int, world_size: int, init_method: str, timeout_s: float = 120.0) -> None:
    """Start-up, once per process: the only communicator this process ever creates."""
    import datetime

    if dist.is_initialized():
        return
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(slots=True)
class Group:
    """Ordered world ranks; `seq` counts this member's collectives (all members run the same
    sequence, so their counters agree and tags match)."""

    ranks: tuple[int, ...]
    gid: int = 0
    seq: int = field(default=0, compare=False)

    @classmethod
    def of(cls, ranks: tuple[int, ...] | list[int], salt: str = "") -> Group:
        ranks = tuple(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"group ranks must be distinct and non-empty, got {ranks}")
        digest = hashlib.blake2b(repr((ranks, salt)).encode(), digest_size=8).digest()
        return cls(ranks, int.from_bytes(digest, "little") % _TAG_SPACE)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int | None = None) -> int:
        rank = dist.get_rank() if rank is None else rank
        return self.ranks.index(rank)  # ValueError: this rank is not a member

    def next_tag(self) -> int:
        self.seq += 1
        return (self.gid + self.seq * 7919) % _TAG_SPACE


def all_to_all(group: Group, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """sends[j] goes to member j; -> recvs[i] from member i (shape recv_shapes[i])."""
    me = group.index()
    tag = group.next_tag()
    recvs: list[torch.Tensor] = [torch.empty(s, dtype=sends[0].dtype) for s in recv_shapes]
    ops = []
    for j, rank in enumerate(group.ranks):
        if j == me:
            recvs[j] = sends[j].clone()
            continue
        ops.append(dist.P2POp(dist.isend, sends[j].contiguous(), rank, tag=tag))
        ops.append(dist.P2POp(dist.irecv, recvs[j], rank, tag=tag))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return recvs


def all_gather(group: Group, tensor: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """-> every member's tensor (shapes[i] from member i), in member order."""
    me = group.index()
    return all_to_all(group, [tensor] * group.size, [tuple(tensor.shape) if i == me else s for i, s in enumerate(shapes)])


def world_info() -> dict[str, int]:
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid()}
