"""Length-aware admission: the waiting row predicted longest goes first, else today's order.

Every waiting row sits in two orders at once: today's queue (the plain deque's arrival order, or
prefix_order.py's with a prefix cache), and a lane per prediction key (policy/length_prediction.py:
the caller's group, or the prompt-length bucket) and max_tokens, in arrival order. While the
predictor has a usable prediction, the head is the head of the lane predicted longest (ties: the
earlier arrival); otherwise it is today's queue's head, so the scheduler makes today's decisions
until predictions have earned their use. A row taken from one order is skipped in the other
when it reaches that one's head (counted, so a row that leaves and comes back is served once).

Harm bound: the queue only permutes rows waiting on one engine and never holds a row back while
a seat and KV are free, so every row still starts by the time this engine's queue drains, as in
today's order; the batch completion time is at most that drain time plus the longest row's run,
the bound today's order has too (it may start the longest row last as well). Predictions that
stop predicting (statistics that flip) turn the ordering off after about `PredictorConfig.window`
/ 4 finishes (the prequential error check). Rows put back at the head (preempted, deferred) go
first, in order, as in the deque. No torch.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator

from ..policy.length_prediction import LengthPredictor, length_key
from .prefix_order import PrefixOrderedQueue
from .sequence import Sequence

GroupOf = Callable[[Sequence], Hashable | None]
Lane = tuple[Hashable, int]
# Entries taken through one order wait in the other until they reach its head; past this many
# (and more than the rows waiting), or when none waits, they are dropped at once: a long job would
# otherwise keep every row it ever ran alive here.
COMPACT_AT = 1024


def no_group(seq: Sequence) -> None:
    """Rows name no group: keys fall back to prompt-length buckets."""
    return None


def row_key(seq: Sequence, group_of: GroupOf) -> Hashable:
    return length_key(group_of(seq), len(seq.prompt_ids))


class LengthOrderedQueue:
    def __init__(self, predictor: LengthPredictor, group_of: GroupOf = no_group,
                 today: deque[Sequence] | PrefixOrderedQueue | None = None) -> None:
        """today: the queue whose order applies while predictions are not used (default: arrival)."""
        self.predictor, self.group_of = predictor, group_of
        self._today: deque[Sequence] | PrefixOrderedQueue = deque() if today is None else today
        self._front: deque[Sequence] = deque()  # put back at the head
        self._lanes: dict[Lane, deque[tuple[int, Sequence]]] = {}
        self._stale_today: Counter[Sequence] = Counter()  # entries already taken through a lane
        self._stale_lanes: Counter[Sequence] = Counter()  # entries already taken through today's queue
        self._num_stale = 0  # entries in both counters
        self._arrival = 0  # an int, not itertools.count: the queue pickles with its engine
        self._count = 0
        self._head: tuple[int, Lane] | None = None  # (predictor version, lane), while nothing changed

    def lane_of(self, seq: Sequence) -> Lane:
        return row_key(seq, self.group_of), int(seq.params.max_tokens)

    def append(self, seq: Sequence) -> None:
        self._today.append(seq)
        self._lanes.setdefault(self.lane_of(seq), deque()).append((self._arrival, seq))
        self._arrival += 1
        self._count += 1
        self._head = None

    def appendleft(self, seq: Sequence) -> None:
        self._front.appendleft(seq)
        self._count += 1

    # -- the two orders' heads, stale entries dropped ------------------------------------------------
    def _live_lane(self, lane: Lane) -> deque[tuple[int, Sequence]] | None:
        rows = self._lanes.get(lane)
        while rows and self._stale_lanes[rows[0][1]]:
            self._drop_stale(self._stale_lanes, rows.popleft()[1])
        if rows is not None and not rows:
            del self._lanes[lane]
            return None
        return rows

    def _today_head(self) -> Sequence:
        while self._stale_today[self._today[0]]:
            self._drop_stale(self._stale_today, self._today.popleft())
        return self._today[0]

    def _drop_stale(self, stale: Counter[Sequence], seq: Sequence) -> None:
        stale[seq] -= 1
        self._num_stale -= 1
        if not stale[seq]:
            del stale[seq]

    def _mark(self, stale: Counter[Sequence], seq: Sequence) -> None:
        stale[seq] += 1
        self._num_stale += 1

    def _compact(self) -> None:
        """Drop every stale entry now (each order keeps its live rows in their order)."""
        def wanted(stale: Counter[Sequence]) -> Callable[[Sequence], bool]:
            def keep(seq: Sequence) -> bool:  # a row's stale entries are its earliest ones
                if stale[seq]:
                    stale[seq] -= 1
                    return False
                return True
            return keep

        if isinstance(self._today, PrefixOrderedQueue):
            self._today.keep(wanted(self._stale_today))
        else:
            self._today = deque(filter(wanted(self._stale_today), self._today))
        keep_lane = wanted(self._stale_lanes)
        lanes = {k: deque(x for x in rows if keep_lane(x[1])) for k, rows in self._lanes.items()}
        self._lanes = {k: rows for k, rows in lanes.items() if rows}
        self._stale_today, self._stale_lanes, self._num_stale = Counter(), Counter(), 0
        self._head = None

    def _lane(self) -> Lane:
        """The lane predicted longest (ties: the earlier head); only while predictions are used."""
        version = self.predictor.version
        if self._head is not None and self._head[0] == version and self._live_lane(self._head[1]):
            return self._head[1]
        live = [lane for lane in list(self._lanes) if self._live_lane(lane)]
        lane = min(live, key=lambda k: (-(self.predictor.predict(k[0], k[1]) or 0.0), self._lanes[k][0][0]))
        self._head = (version, lane)
        return lane

    # -- the deque operations the scheduler uses ------------------------------------------------------
    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("LengthOrderedQueue gives its head only ([0])")
        if self._front:
            return self._front[0]
        if not self._count:
            raise IndexError("waiting queue is empty")
        if self.predictor.confident:
            return self._lanes[self._lane()][0][1]
        return self._today_head()

    def popleft(self) -> Sequence:
        if self._front:
            self._count -= 1
            return self._front.popleft()
        if not self._count:
            raise IndexError("waiting queue is empty")
        if self.predictor.confident:
            seq = self._lanes[self._lane()].popleft()[1]
            self._mark(self._stale_today, seq)
        else:
            seq = self._today_head()
            self._today.popleft()
            self._mark(self._stale_lanes, seq)
        self._head = None  # the lane's next head arrived later: another lane may go first now
        self._count -= 1
        self._maybe_compact()
        return seq

    def _maybe_compact(self) -> None:
        if self._num_stale and (not self._count or self._num_stale > max(COMPACT_AT, self._count)):
            self._compact()

    def remove(self, seq: Sequence) -> None:
        if seq in self._front:  # Sequence compares by identity
            self._front.remove(seq)
        elif self._live_entries(seq) > 0:
            self._mark(self._stale_today, seq)
            self._mark(self._stale_lanes, seq)
            self._head = None
        else:
            raise ValueError("sequence is not waiting")
        self._count -= 1
        self._maybe_compact()

    def _live_entries(self, seq: Sequence) -> int:
        entries = sum(s is seq for _, s in self._lanes.get(self.lane_of(seq), ()))
        return entries - self._stale_lanes[seq]

    def __contains__(self, seq: object) -> bool:
        if seq in self._front:
            return True
        return isinstance(seq, Sequence) and self._live_entries(seq) > 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Sequence]:
        """In admission order as far as it is decided now (later finishes may reorder lanes)."""
        yield from self._front
        if self.predictor.confident:
            stale = Counter(self._stale_lanes)
            ranked = sorted(((k, rows) for k, rows in self._lanes.items()),
                            key=lambda kv: (-(self.predictor.predict(kv[0][0], kv[0][1]) or 0.0),
                                            min((a for a, s in kv[1] if not stale[s]), default=0)))
            entries: Iterator[Sequence] = (s for _, rows in ranked for _, s in rows)
        else:
            stale = Counter(self._stale_today)
            entries = iter(self._today)
        for seq in entries:
            if stale[seq]:
                stale[seq] -= 1
                continue
            yield seq
