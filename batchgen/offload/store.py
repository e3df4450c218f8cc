"""ExpertStore: routed experts tiered over a device pool, host memory and the checkpoint on disk.

    disk (checkpoint, read per expert) --reader threads--> host (pinned on CUDA) --copy--> device pool

A MoE stage asks for the experts its combined tokens route to (`fetch`); each missing one is
brought once into the device pool, from the host tier when it is there, else from disk, and the
kernel runs on the pool with token->expert ids remapped to slots. Because the runtime runs each
layer's MoE stage once on all attention micro-batches of a forward, one copy serves the whole
expert batch.

After a stage, the experts the next MoE layer will probably need are fetched ahead: from disk
into host memory by reader threads (both devices), and on CUDA from host into the device pool
on a side stream. Which experts: the next layer's recent routing (`history`), or its router run
early on this stage's hidden state (`router`). A fetch that finds its expert still in flight
waits for it; that wait is the time reported as `expert_fetch_wait_s`.

Eviction (policy/expert_eviction.py) weighs how likely an expert is needed again against how soon its
layer runs; it never evicts what the current stage needs or a slot a read is filling.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from ..policy.expert_eviction import RoutingStats, TierPlan, next_moe_layer, resolve_predictor
from .disk import DiskExperts, ExpertReadError
from .pool import Key, Pending, SlotPool
from .state import HostExperts, StoreOptions, StoreStats

RouterPredict = Callable[[int, torch.Tensor], list[int]]  # (MoE layer, hidden [T, H]) -> expert ids


class ExpertStore:
    def __init__(self, plan: TierPlan, num_experts: dict[int, int], w13_shape: tuple[int, int],
                 w2_shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                 host_experts: dict[int, HostExperts] | None = None, disk: DiskExperts | None = None,
                 options: StoreOptions = StoreOptions(), router_predict: RouterPredict | None = None) -> None:
        """num_experts: MoE layer -> routed experts. host_experts: every layer's experts in host
        memory (plan.host_slots None); disk: the checkpoint reader (plan.host_slots set)."""
        if (host_experts is None) == (disk is None):
            raise ValueError("ExpertStore needs exactly one of host_experts and disk")
        self.plan, self.num_experts, self.options = plan, num_experts, options
        self.predictor = resolve_predictor(options.predictor, device.type)
        self.device, self.dtype = device, dtype
        self.order = sorted(num_experts)  # forward order of the MoE layers
        self.positions = {layer: i for i, layer in enumerate(self.order)}
        self.host_experts, self.disk, self.router_predict = host_experts, disk, router_predict
        cuda = device.type == "cuda"
        self.host: SlotPool | None = None
        if disk is not None:
            assert plan.host_slots is not None
            self.host = SlotPool(plan.host_slots, w13_shape, w2_shape, dtype, torch.device("cpu"), pin=cuda)
        self.pool = self.host if plan.shared else SlotPool(plan.device_slots, w13_shape, w2_shape, dtype, device)
        assert self.pool is not None
        self.slots, self.expert_bytes = self.pool.slots, self.pool.expert_bytes
        self.routing = RoutingStats()
        self.stats = StoreStats()
        self._tick = 0
        self._predicted: dict[int, set[int]] = {}  # MoE layer -> experts named for its next stage
        self._prefetched: set[Key] = set()  # read ahead from disk and not yet used
        self._copied_ahead: set[Key] = set()  # CUDA: copied ahead host -> device pool, not yet used
        self._closed = False
        self._readers = ThreadPoolExecutor(options.io_threads, thread_name_prefix="batchgen-expert-io") \
            if disk is not None else None
        self._copy_stream = torch.cuda.Stream(device) if cuda else None

    # -- a MoE stage ------------------------------------------------------------------------------
    def fetch(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """topk_ids [T, A] of `layer` -> (pool w13 [S, 2N, H], pool w2 [S, H, N], ids remapped
        to pool slots [T, A]), every needed expert in the pool. x [T, H]: the stage's input (the
        router predictor reads it). Raises ExpertReadError when an expert cannot be read."""
        self._check_open()
        t0 = time.perf_counter()
        st = self.stats
        needed = self._begin_stage(layer, topk_ids)
        keep = {(layer, e) for e in needed}
        for e in needed:  # reads ahead into the pool itself (shared tier) that this stage needs
            if (layer, e) in self.pool.pending:
                self._wait((layer, e), self.pool)
        missing = [e for e in needed if not self.pool.holds((layer, e))]
        st.stages += 1
        st.experts_needed += len(needed)
        st.device_hits += len(needed) - len(missing)
        if missing:
            if self.host is not None and not self.plan.shared:
                self._bring_to_host(layer, missing, keep)
            slots = self._take(self.pool, len(missing), keep, layer)
            for i, (e, slot) in enumerate(zip(missing, slots)):
                try:
                    self._fill(layer, e, slot)
                except BaseException:
                    for unused in slots[i:]:
                        self.pool.release(unused)
                    raise
                self.pool.put((layer, e), slot, self._tick)
        for e in needed:
            self._used(layer, e)
        self._wait_device_copies(needed, layer)
        lut = torch.zeros(self.num_experts[layer], dtype=torch.long)
        lut[needed] = torch.tensor([self.pool.where[(layer, e)] for e in needed], dtype=torch.long)
        st.fetch_wait_s += time.perf_counter() - t0
        self._prefetch_after(layer, x, keep)
        return self.pool.w13, self.pool.w2, lut.to(topk_ids.device)[topk_ids]

    def fetch_parts(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Like `fetch`, in parts: with overlap_reads, where experts are read from disk straight
        into the pool (the CPU host cache), the stage's misses are read by the reader threads
        and each part holds the experts that have landed (ids of the others -1: not routed), so
        computing some experts overlaps reading the others. Every needed expert is in exactly one
        part. Otherwise one part, `fetch`'s. On by default: with reads that reach the disk
        (bench_offload --cold-disk) it measured 0.34x of the resident engine against 0.29x
        without; where the file sits in the page cache a read is a copy that needs a core of its
        own, and on this 2-core machine it measured 0.62x against 0.69x."""
        self._check_open()
        if not self.options.overlap_reads or not self.plan.shared or self._readers is None:
            yield self.fetch(layer, x, topk_ids)
            return
        t0 = time.perf_counter()
        st, pool, disk = self.stats, self.pool, self.disk
        assert disk is not None
        needed = self._begin_stage(layer, topk_ids)
        keep = {(layer, e) for e in needed}
        st.stages += 1
        st.experts_needed += len(needed)
        # reads ahead still in flight count as hits: the stage did not have to start them
        st.device_hits += sum(pool.holds((layer, e)) or (layer, e) in pool.pending for e in needed)
        busy = time.perf_counter() - t0
        done: set[int] = set()
        while len(done) < len(needed):
            t1 = time.perf_counter()
            todo = [e for e in needed if e not in done]  # computed experts may be evicted now
            absent = [e for e in todo if not pool.holds((layer, e)) and (layer, e) not in pool.pending]
            if absent:  # misses, and reads ahead that failed: read now, in the reader threads
                protect = {(layer, e) for e in todo}
                for e, slot in zip(absent, self._take(pool, len(absent), protect, layer)):
                    future = self._readers.submit(disk.read, layer, e, pool.w13[slot], pool.w2[slot])
                    pool.pending[(layer, e)] = Pending(slot, future, prefetched=False)
            ready = [e for e in todo if pool.holds((layer, e))]
            if not ready:  # wait for half the reads to land (fewer, larger parts: each costs a
                # kernel call's sort), then compute those while the rest are read; a failed read
                # fails the stage
                futures = [pool.pending[(layer, e)].future for e in todo if (layer, e) in pool.pending]
                wait_futures(futures[:(len(futures) + 1) // 2])
                for e in todo:
                    pending = pool.pending.get((layer, e))
                    if pending is not None and pending.future.done():
                        error = pending.future.exception()
                        self._settle((layer, e), pool, pending)
                        if error is not None:
                            raise error
                busy += time.perf_counter() - t1
                continue
            lut = torch.full((self.num_experts[layer],), -1, dtype=torch.long)
            lut[ready] = torch.tensor([pool.where[(layer, e)] for e in ready], dtype=torch.long)
            for e in ready:
                self._used(layer, e)
            done.update(ready)
            busy += time.perf_counter() - t1
            yield pool.w13, pool.w2, lut.to(topk_ids.device)[topk_ids]  # the caller computes these now
        st.fetch_wait_s += busy
        self._prefetch_after(layer, x, keep)

    def _used(self, layer: int, e: int) -> None:
        key = (layer, e)
        self.pool.last_use[key] = self._tick
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.stats.prefetch_reads_used += 1
        if key in self._copied_ahead:
            self._copied_ahead.discard(key)
            self.stats.prefetch_copies_used += 1

    def _bring_to_host(self, layer: int, experts: list[int], keep: set[Key]) -> None:
        """Make the host tier hold `experts` (the device misses of a stage): wait for reads
        ahead in flight, read the rest from disk into slots taken in one eviction decision."""
        host, st = self.host, self.stats
        assert host is not None
        st.host_lookups += len(experts)
        for e in experts:
            if (layer, e) in host.pending:
                self._wait((layer, e), host)
        absent = [e for e in experts if not host.holds((layer, e))]
        st.host_hits += len(experts) - len(absent)
        slots = self._take(host, len(absent), keep, layer)
        for i, (e, hslot) in enumerate(zip(absent, slots)):
            try:
                st.bytes_from_disk += self._read(layer, e, hslot, host)
            except BaseException:
                for unused in slots[i:]:
                    host.release(unused)
                raise
            host.put((layer, e), hslot, self._tick)
        for e in experts:
            host.last_use[(layer, e)] = self._tick

    def _take(self, pool: SlotPool, count: int, keep: set[Key], layer: int) -> list[int]:
        """`count` slots of `pool` for the stage of `layer`; reads ahead still in flight hold
        their slots, so when too few are evictable those reads are landed first."""
        if pool.num_evictable(keep) < count:
            for key in list(pool.pending):
                self._wait(key, pool)
        slots = pool.take(count, keep, self.positions[layer], self.positions, self.options.eviction, self.routing)
        ahead = self._prefetched if pool is self.host else self._copied_ahead
        ahead.difference_update(pool.evicted)  # evicted unused: no longer a read ahead to count
        return slots

    def _fill(self, layer: int, e: int, slot: int) -> None:
        """Bring expert e of `layer` into device slot `slot` (from the host tier, which
        _bring_to_host filled, or from the experts all held in host memory, or from disk when
        the pool is the host cache itself)."""
        st, key = self.stats, (layer, e)
        if self.plan.shared:  # the pool is the host cache: straight from disk
            st.bytes_from_disk += self._read(layer, e, slot)
            return
        if self.host_experts is not None:
            src13, src2 = self.host_experts[layer].w13[e], self.host_experts[layer].w2[e]
        else:
            host = self.host
            assert host is not None
            src13, src2 = host.w13[host.where[key]], host.w2[host.where[key]]
        self.pool.w13[slot].copy_(src13, non_blocking=True)
        self.pool.w2[slot].copy_(src2, non_blocking=True)
        st.bytes_from_host += self.expert_bytes
        if self._copy_stream is not None and self.host is not None:
            event = torch.cuda.Event()  # the pinned host slot must not be refilled before this copy lands
            event.record(torch.cuda.current_stream(self.device))
            self.host.ready_events[self.host.where[key]] = event

    def _read(self, layer: int, e: int, slot: int, pool: SlotPool | None = None) -> int:
        pool = pool or self.pool
        assert self.disk is not None
        nbytes = self.disk.read(layer, e, pool.w13[slot], pool.w2[slot])
        self.stats.disk_reads += 1
        return nbytes

    # -- reads ahead ------------------------------------------------------------------------------
    def _prefetch_after(self, layer: int, x: torch.Tensor, keep: set[Key]) -> None:
        """Start fetching what the next MoE layer will probably need."""
        if self.predictor == "none":
            return
        nxt = next_moe_layer(layer, self.order)
        if self.predictor == "router" and self.router_predict is not None:
            predicted = self.router_predict(nxt, x)
        else:
            predicted = self.routing.predict(nxt)
        self._predicted[nxt] = set(predicted)
        if self.host is not None:
            self._read_ahead(nxt, predicted, keep)
        if self._copy_stream is not None:
            self._land_reads()  # earlier reads ahead that have landed can go on to the device too
            self._copy_ahead(nxt, predicted, keep)

    def _read_ahead(self, layer: int, experts: list[int], keep: set[Key]) -> None:
        """Disk -> host tier in the reader threads, into slots reserved now (this thread owns
        all bookkeeping; a reader only fills the slot it was given)."""
        host, disk, readers = self.host, self.disk, self._readers
        assert host is not None and disk is not None and readers is not None
        wanted = [e for e in experts if not host.holds((layer, e)) and (layer, e) not in host.pending
                  and not (not self.plan.shared and self.pool.holds((layer, e)))]
        protect = keep | {(layer, e) for e in experts}
        count = min(len(wanted), host.num_evictable(protect))
        for e in wanted[count:]:  # no slot to spare: at least have the OS read them ahead
            disk.advise(layer, e)
        if count <= 0:
            return
        slots = self._take(host, count, protect, layer)
        for e, slot in zip(wanted, slots):
            future = readers.submit(disk.read, layer, e, host.w13[slot], host.w2[slot])
            host.pending[(layer, e)] = Pending(slot, future)

    def _copy_ahead(self, layer: int, experts: list[int], keep: set[Key]) -> None:
        """CUDA: host tier -> device pool on a side stream, for predicted experts already in host
        memory. The side stream first waits for the compute stream, so no slot is overwritten
        while a kernel before it still reads it; the compute stream waits on the slot's event
        before its own kernel reads it (_wait_device_copies)."""
        stream = self._copy_stream
        assert stream is not None
        sources = []
        for e in experts:
            key = (layer, e)
            if self.pool.holds(key):
                continue
            if self.host_experts is not None:
                sources.append((e, self.host_experts[layer].w13[e], self.host_experts[layer].w2[e], None))
            elif self.host is not None and self.host.holds(key):
                hslot = self.host.where[key]
                sources.append((e, self.host.w13[hslot], self.host.w2[hslot], hslot))
        protect = keep | {(layer, e) for e in experts}
        count = min(len(sources), self.pool.num_evictable(protect))
        if count <= 0:
            return
        slots = self._take(self.pool, count, protect, layer)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for (e, w13, w2, hslot), slot in zip(sources, slots):
                self.pool.w13[slot].copy_(w13, non_blocking=True)
                self.pool.w2[slot].copy_(w2, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self.pool.ready_events[slot] = event
                if hslot is not None and self.host is not None:
                    self.host.ready_events[hslot] = event  # the host slot must outlive the copy
                self.pool.put((layer, e), slot, self._tick)
                self._copied_ahead.add((layer, e))
                self.stats.bytes_from_host += self.expert_bytes
                self.stats.prefetch_copies += 1

    def _wait_device_copies(self, needed: list[int], layer: int) -> None:
        if self._copy_stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for e in needed:
            event = self.pool.ready_events.get(self.pool.where[(layer, e)])
            if event is not None:
                current.wait_event(event)  # type: ignore[arg-type]

    def _land_reads(self) -> None:
        """Reads ahead that have finished become residents; failed ones give their slot back
        (the expert is read again, and its error raised, if a stage really needs it)."""
        host = self.host
        if host is None:
            return
        for key, pending in list(host.pending.items()):
            if pending.future.done():
                self._settle(key, host, pending)

    def _wait(self, key: Key, pool: SlotPool) -> None:
        pending = pool.pending[key]
        try:
            pending.future.result()
        except ExpertReadError:
            pass  # _settle frees the slot; the caller reads it again and raises there
        self._settle(key, pool, pending)

    def _settle(self, key: Key, pool: SlotPool, pending: Pending) -> None:
        del pool.pending[key]
        error = pending.future.exception()
        if error is not None:
            pool.release(pending.slot)
            return
        pool.put(key, pending.slot, self._tick)
        self.stats.bytes_from_disk += pending.future.result()
        self.stats.disk_reads += 1
        if pending.prefetched:
            self.stats.prefetch_reads += 1
            self._prefetched.add(key)

    def _begin_stage(self, layer: int, topk_ids: torch.Tensor) -> list[int]:
        """A MoE stage starts: -> the experts it needs. Scores the prediction made for it,
        updates the routing statistics, lands the reads ahead that have finished."""
        self._tick += 1
        needed = torch.unique(topk_ids).tolist()
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.stats.predicted += len(predicted)
            self.stats.predicted_used += len(predicted.intersection(needed))
        self.routing.observe(layer, self.num_experts[layer], needed)
        self._land_reads()
        return needed

    # -- reporting and life ------------------------------------------------------------------------
    def summary(self, generated_tokens: int) -> dict[str, float]:
        return self.stats.summary(self.plan, self.slots, generated_tokens)

    def resident(self, layer: int) -> list[int]:
        """Experts of `layer` in the device pool now."""
        return self.pool.resident(layer)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed: its expert store no longer reads the checkpoint")

    def close(self) -> None:
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
            self._readers = None
        if self.disk is not None:
            self.disk.close()
