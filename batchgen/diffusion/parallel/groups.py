"""Group-free collectives: one world communicator (torch.distributed, gloo) set up once; a group is
a local descriptor (ordered ranks, hashed id) and its collectives run over point-to-point sends
tagged with (group id, sequence number). Forming a group talks to nobody; ranks outside it never
take part (torch.distributed.new_group, by contrast, must be entered by every rank of the world).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_TAG_SPACE = 2**31 - 1
_SLOT = 1 << 16  # bytes of a world all-gather's fixed slot (all_gather_bytes)


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


def all_gather_bytes(group: Group, payload: bytes) -> list[bytes]:
    """-> every member's bytes, in member order (lengths first, then the bytes). A group of the
    whole world uses the world communicator's own all-gather (set up at start-up; gloo's
    collective is faster than its point-to-point path)."""
    if sorted(group.ranks) == list(range(dist.get_world_size())):
        # one collective when every payload fits a fixed slot (8-byte length, then the bytes):
        # each collective is a wait for every member, costly on a loaded machine
        slot = torch.zeros(8 + _SLOT, dtype=torch.uint8)
        slot[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        if len(payload) <= _SLOT:
            slot[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        slots = [torch.empty_like(slot) for _ in range(group.size)]
        dist.all_gather(slots, slot)
        lengths = [int(x[:8].view(torch.int64).item()) for x in slots]
        if max(lengths) <= _SLOT:
            return [slots[r][8:8 + lengths[r]].numpy().tobytes() for r in group.ranks]
        parts: list = [None] * group.size
        dist.all_gather_object(parts, payload)
        return [parts[r] for r in group.ranks]
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    lengths = all_gather(group, torch.tensor([len(payload)], dtype=torch.int64), [(1,)] * group.size)
    parts = all_gather(group, mine, [(int(n.item()),) for n in lengths])
    return [p.numpy().tobytes() for p in parts]


def send_recv_bytes(moves: list[tuple[int, int, int]], payloads: dict[int, bytes]) -> dict[int, bytes]:
    """Point-to-point copies among any ranks: moves are (source rank, destination rank, key),
    listed alike by every rank; this rank sends payloads[key] where it is the source and -> the
    bytes it receives, by key. Tags come from (source, destination, key), so unrelated copies
    between the same pair never mix."""
    me = dist.get_rank()
    mine = [(s, d, k) for s, d, k in moves if me in (s, d) and s != d]
    if not mine:
        return {}

    def tag(s: int, d: int, k: int, part: int) -> int:
        digest = hashlib.blake2b(repr((s, d, k, part)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % _TAG_SPACE

    sizes = {m: torch.tensor([len(payloads[m[2]]) if m[0] == me else 0], dtype=torch.int64) for m in mine}
    ops = [dist.P2POp(dist.isend if s == me else dist.irecv, sizes[(s, d, k)], d if s == me else s,
                      tag=tag(s, d, k, 0)) for s, d, k in mine]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    bufs = {m: (torch.frombuffer(bytearray(payloads[m[2]]), dtype=torch.uint8) if m[0] == me
                else torch.empty(int(sizes[m].item()), dtype=torch.uint8)) for m in mine}
    ops = [dist.P2POp(dist.isend if s == me else dist.irecv, bufs[(s, d, k)], d if s == me else s,
                      tag=tag(s, d, k, 1)) for s, d, k in mine]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {k: bufs[(s, d, k)].numpy().tobytes() for s, d, k in mine if d == me}
