"""``throttle simulate``: what proposed limits would have done to recent traffic.

The record (``throttle_record``: each task's arrival with its scope, key, cost, priority and
the rates and K in force, its start, its body's end) is replayed key by key through a model
of its line: first come first served within a priority (the same places as line.lua's, the
same aging rule), each task started at the earliest its rates (an exact window of every
start, sliding or fixed) and its K (each body running as long as it ran) admit it. The
rates and K are the ones recorded, or those proposed for its scope or key; the start each
task would have had is set beside the one it had.

A scope whose K its keys share (``share=``) is replayed whole: each slot, as it frees, to
the key with work whose bodies, with it, are fewest for its weight. Proposals: rates, K,
a key's weight, a priority per task name, or none at all (first come first served).

A model, not the store's script: no slack, no lead, no leases, no margins; a body's cost as
estimated at its check (a ``charge()`` after it is not in the record). Run with nothing
proposed, it says how far the model is from what happened.
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.priority import check_urgency, place_of
from ..core.rates import Rate, parse_rates
from ..core.timing import SCRIPT_POLICY

__all__ = ["Outcome", "Proposal", "Task", "replay", "tasks_of", "waits"]

#: Passes over a task's rates and K in search of a start every one admits (as window.lua's
#: SETTLE_ROUNDS): each only moves it later.
SETTLE_ROUNDS = 64


@dataclass
class Task:
    """One task of the record."""

    id: str
    scope: str
    key: str | None
    arrive: int
    #: Units of every rate, or one count per recorded rate.
    cost: int | tuple[int, ...]
    urgency: int
    rates: tuple[Rate, ...]
    algorithm: str
    concurrency: int
    start: int | None = None
    end: int | None = None
    #: The task's name (a proposed priority names it).
    name: str = ""
    #: Its key's weight in its scope's share of K, and the most slots the key may hold (0:
    #: no cap); None: no share.
    weight: float | None = None
    most: int = 0

    @property
    def duration(self) -> int:
        return max(self.end - self.start, 0) if self.start is not None and self.end is not None else 0

    def units(self, rates: Sequence[Rate]) -> list[int]:
        """Its cost of each of ``rates``: by unit, as it was counted under the recorded ones."""
        if isinstance(self.cost, int):
            return [self.cost] * len(rates)
        by_unit = {r.unit: c for r, c in zip(self.rates, self.cost)}
        return [by_unit.get(r.unit, 1) for r in rates]


@dataclass
class Proposal:
    """Limits to try: rates and K by scope (``None`` key: every key of it without its own)
    or by scope and key; ``fifo``: every task of one priority."""

    rates: dict[tuple[str, str | None], tuple[Rate, ...]] = field(default_factory=dict)
    concurrency: dict[tuple[str, str | None], int] = field(default_factory=dict)
    fifo: bool = False
    #: A key's weight in its scope's share, by scope and key.
    weights: dict[tuple[str, str | None], float] = field(default_factory=dict)
    #: A priority (urgency: higher first) for the tasks of a name, in place of theirs.
    priorities: dict[str, int] = field(default_factory=dict)

    def urgency_of(self, task: Task) -> int:
        if self.fifo:
            return 0
        return self.priorities.get(task.name, task.urgency)

    def weight_of(self, task: Task) -> float:
        return self.weights.get((task.scope, task.key)) or task.weight or 1.0

    def rates_of(self, task: Task) -> tuple[Rate, ...]:
        return self.rates.get((task.scope, task.key)) or self.rates.get((task.scope, None)) or task.rates

    def concurrency_of(self, task: Task) -> int:
        return self.concurrency.get((task.scope, task.key)) or self.concurrency.get((task.scope, None)) \
            or task.concurrency

    @staticmethod
    def target(text: str) -> tuple[str, str | None]:
        """``scope`` or ``scope:key`` (the first ``:`` splits them)."""
        scope, sep, key = text.partition(":")
        return scope, (key if sep else None)

    @classmethod
    def parse(cls, rates: Iterable[str] = (), concurrency: Iterable[str] = (), fifo: bool = False,
              weights: Iterable[str] = (), priorities: Iterable[str] = ()) -> Proposal:
        """From ``SCOPE[:KEY]=RATE[,RATE...]``, ``SCOPE[:KEY]=K``, ``SCOPE:KEY=WEIGHT`` and
        ``TASK_NAME=PRIORITY`` texts."""
        proposal = cls(fifo=fifo)
        for text in weights:
            target, _, value = text.rpartition("=")
            weight = float(value)
            if not weight > 0:
                raise ValueError(f"a weight is more than 0, got {value!r}")
            proposal.weights[cls.target(target)] = weight
        for text in priorities:
            name, _, value = text.rpartition("=")
            proposal.priorities[name] = check_urgency(int(value), f"the priority of {name}")
        for text in rates:
            target, _, value = text.rpartition("=")
            proposal.rates[cls.target(target)] = parse_rates(value.split(","))
        for text in concurrency:
            target, _, value = text.rpartition("=")
            slots = int(value)
            if slots < 1:
                raise ValueError(f"a concurrency limit is at least 1, got {value!r}")
            proposal.concurrency[cls.target(target)] = slots
        return proposal


@dataclass
class Outcome:
    """What one key did and would have done: each task's wait (µs), as it was (None: not
    started in the record) and as it would have been (None: its cost never fits)."""

    scope: str
    key: str | None
    did: list[int | None]
    would: list[int | None]
    rates: tuple[Rate, ...]
    concurrency: int


def tasks_of(events: Iterable[str | Mapping[str, Any]]) -> tuple[list[Task], int]:
    """The tasks of the record's events (a JSON text or a mapping each), by arrival; and
    how many events named a task whose arrival is not in them (it came before the span)."""
    tasks: dict[str, Task] = {}
    later: list[Mapping[str, Any]] = []
    for raw in events:
        event = json.loads(raw) if isinstance(raw, str) else raw
        if event.get("k") == "a":
            cost = event["c"]
            tasks[str(event["id"])] = Task(
                str(event["id"]), str(event["s"]), event.get("key"), int(event["t"]),
                tuple(cost) if isinstance(cost, list) else int(cost), int(event.get("u") or 0),
                parse_rates(event["r"].split(",")) if event.get("r") else (), str(event.get("a") or "sliding"),
                int(event.get("n") or 0), name=str(event.get("task") or ""),
                weight=None if event.get("w") is None else float(event["w"]), most=int(event.get("m") or 0))
        else:
            later.append(event)
    orphans = 0
    for event in later:
        task = tasks.get(str(event.get("id")))
        if task is None:
            orphans += 1
        elif event.get("k") == "s" and task.start is None:
            task.start = int(event["t"])
        elif event.get("k") == "e":
            task.end = int(event["t"])
    return sorted(tasks.values(), key=lambda t: (t.arrive, t.id)), orphans


class _Windows:
    """Every start of one key under its rates, exactly (no buckets), and its bodies' ends."""

    def __init__(self, rates: tuple[Rate, ...], algorithm: str, concurrency: int) -> None:
        self.rates, self.algorithm, self.concurrency = rates, algorithm, concurrency
        self.logs: list[deque[tuple[int, int]]] = [deque() for _ in rates]
        self.fixed: list[dict[int, int]] = [defaultdict(int) for _ in rates]
        self.ends: list[int] = []

    def earliest(self, x: int, units: list[int]) -> int | None:
        """The earliest start from ``x`` on every rate and K admit ``units``; None: never."""
        if any(u > r.limit for u, r in zip(units, self.rates)):
            return None
        for log, r in zip(self.logs, self.rates):
            while log and log[0][0] <= x - r.period_us:
                log.popleft()  # (``x``, the replay's now, only moves on: what left never counts again)
        for _ in range(SETTLE_ROUNDS):
            moved = False
            for i, (r, u) in enumerate(zip(self.rates, units)):
                e = self._sliding(i, r, u, x) if self.algorithm == "sliding" else self._fixed(i, r, u, x)
                if e > x:
                    x, moved = e, True
            if self.concurrency:
                running = sorted(t for t in self.ends if t > x)
                if len(running) >= self.concurrency:
                    x, moved = running[len(running) - self.concurrency], True
            if not moved:
                return x
        return x

    def _sliding(self, i: int, r: Rate, units: int, x: int) -> int:
        inside = [(at, u) for at, u in self.logs[i] if at > x - r.period_us]
        excess = sum(u for _, u in inside) + units - r.limit
        for at, u in inside:
            if excess <= 0:
                break
            excess -= u
            x = at + r.period_us
        return x

    def _fixed(self, i: int, r: Rate, units: int, x: int) -> int:
        window = x // r.period_us
        while self.fixed[i][window] + units > r.limit:
            window += 1
        return max(x, window * r.period_us)

    def start(self, at: int, units: list[int], duration: int) -> None:
        for i, (r, u) in enumerate(zip(self.rates, units)):
            self.logs[i].append((at, u))
            self.fixed[i][at // r.period_us] += u
        if self.concurrency:
            self.ends = [t for t in self.ends if t > at]
            self.ends.append(at + duration)


def _joins(line: list[tuple[float, int, Task]], given: int, task: Task, proposal: Proposal) -> None:
    heapq.heappush(line, (place_of(given, proposal.urgency_of(task), SCRIPT_POLICY.priority_step), given, task))


def replay_key(tasks: Sequence[Task], proposal: Proposal) -> dict[str, int | None]:
    """The start each task of one key (by arrival) would have had under ``proposal``."""
    first = tasks[0]
    windows = _Windows(proposal.rates_of(first), first.algorithm, proposal.concurrency_of(first))
    line: list[tuple[float, int, Task]] = []
    starts: dict[str, int | None] = {}
    now, i, given = 0, 0, 0
    while i < len(tasks) or line:
        if not line:
            given += 1
            task = tasks[i]
            _joins(line, given, task, proposal)
            now, i = max(now, task.arrive), i + 1
            continue
        head = line[0][2]
        units = head.units(windows.rates)
        at = windows.earliest(now, units)
        if at is not None and i < len(tasks) and tasks[i].arrive <= at:
            # (one that came before the head could start: it may go before it)
            given += 1
            task = tasks[i]
            _joins(line, given, task, proposal)
            now, i = max(now, task.arrive), i + 1
            continue
        heapq.heappop(line)
        starts[head.id] = at
        if at is not None:
            windows.start(at, units, head.duration)
            now = at
    return starts


class _Key:
    """One key of a scope whose K its keys share: its line, its windows, its bodies' ends."""

    def __init__(self, first: Task, proposal: Proposal) -> None:
        self.windows = _Windows(proposal.rates_of(first), first.algorithm, 0)
        self.line: list[tuple[float, int, Task]] = []
        self.ends: list[int] = []
        self.weight, self.most = proposal.weight_of(first), first.most

    def running(self, now: int) -> int:
        self.ends = [t for t in self.ends if t > now]
        return len(self.ends)

    def head_at(self, now: int) -> int | None:
        head = self.line[0][2]
        return self.windows.earliest(now, head.units(self.windows.rates))


def replay_shared(tasks: Sequence[Task], proposal: Proposal) -> dict[str, int | None]:
    """The start each task of a scope whose K its keys share (by arrival) would have had:
    each slot, as it frees, to the key with work whose bodies, with it, are fewest for its
    weight (slots in proportion to the weights of the keys with work, as the sharer's
    weighted max-min hands them, at once rather than a few times a second; a tie to the
    key whose head came first), within the key's most and its own rates."""
    first = tasks[0]
    slots = proposal.concurrency.get((first.scope, None)) or first.concurrency or 1
    keys: dict[str | None, _Key] = {}
    starts: dict[str, int | None] = {}
    i, given, now = 0, 0, tasks[0].arrive
    while True:
        while i < len(tasks) and tasks[i].arrive <= now:
            task = tasks[i]
            key = keys.setdefault(task.key, _Key(task, proposal))
            given += 1
            _joins(key.line, given, task, proposal)
            i += 1
        while True:  # (every slot free now to the key owed most that may start now)
            if sum(k.running(now) for k in keys.values()) >= slots:
                break
            ready = []
            for name, k in keys.items():
                while k.line and k.head_at(now) is None:  # (a cost that never fits its rates)
                    starts[heapq.heappop(k.line)[2].id] = None
                if k.line and (not k.most or k.running(now) < k.most) and k.head_at(now) == now:
                    ready.append(((k.running(now) + 1) / k.weight, k.line[0][2].arrive, name or "", name))
            if not ready:
                break
            k = keys[min(ready)[3]]
            head = heapq.heappop(k.line)[2]
            units = head.units(k.windows.rates)
            k.windows.start(now, units, 0)
            k.ends.append(now + head.duration)
            starts[head.id] = now
        nexts = [tasks[i].arrive] if i < len(tasks) else []
        nexts += [t for k in keys.values() for t in k.ends if t > now]
        nexts += [at for k in keys.values() if k.line and (at := k.head_at(now)) is not None and at > now]
        if not nexts:
            for k in keys.values():  # (nothing left to happen: what waits never starts)
                starts.update((entry[2].id, None) for entry in k.line)
            return starts
        now = min(nexts)


def replay(tasks: Sequence[Task], proposal: Proposal) -> list[Outcome]:
    """Every key's tasks replayed under ``proposal``, keys by scope and key (the keys of a
    scope whose K they share, together)."""
    by_key: dict[tuple[str, str | None], list[Task]] = defaultdict(list)
    by_scope: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        by_key[(task.scope, task.key)].append(task)
        by_scope[task.scope].append(task)
    # (A scope any of whose tasks shared its K, all of them: a record across a deploy of
    # share= holds both.)
    starts_of_scope = {scope: replay_shared(own, proposal) for scope, own in by_scope.items()
                       if any(t.weight is not None for t in own)}
    out = []
    for (scope, key), own in sorted(by_key.items(), key=lambda item: (item[0][0], item[0][1] or "")):
        starts = starts_of_scope[scope] if scope in starts_of_scope else replay_key(own, proposal)
        would = [None if starts[t.id] is None else starts[t.id] - t.arrive for t in own]  # type: ignore[operator]
        did = [None if t.start is None else max(t.start - t.arrive, 0) for t in own]
        out.append(Outcome(scope, key, did, would, proposal.rates_of(own[0]), proposal.concurrency_of(own[0])))
    return out


def waits(values: Sequence[int | None]) -> dict[str, float | int | None]:
    """p50, p95 and the most of the waits known (seconds), and how many are not."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return {"p50": None, "p95": None, "max": None, "unknown": len(values)}

    def at(q: float) -> float:
        return round(known[min(int(q * len(known)), len(known) - 1)] / 1e6, 3)

    return {"p50": at(0.5), "p95": at(0.95), "max": round(known[-1] / 1e6, 3), "unknown": len(values) - len(known)}
