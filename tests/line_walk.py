"""The walks of tests/script/test_line_model.py: one key walked on a real Redis (window.lua
with line.lua, through ``RedisStore`` with an injected clock) and on
``tests.line_reference.KeyModel`` at once, every reply and everything stored compared, and
the truth kept beside (what started when, what joined the line and how it ended), so that
the properties the test module states are asserted at every step."""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from celery_throttle.core.keys import share_key, state_key, wake_key, window_keys
from celery_throttle.core.protocol import REPLY_PLACES, Code, WindowCall, WindowReply
from celery_throttle.core.rates import Rate, parse_rate
from celery_throttle.core.state import rate_field
from celery_throttle.store.client import RedisStore
from tests.helpers import QUICK
from tests.line_reference import Call, KeyModel
from tests.reference import max_units_in_any_interval, max_units_per_aligned_window

STEPS = 120 if QUICK else 400


class FakeClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def _units(names: tuple[str, ...]) -> list[str]:
    return [parse_rate(n).unit for n in names]


@dataclass
class Start:
    """A body that started: its span, and its units per rate as known now."""

    at: int
    latest: int
    units: list[int]
    #: Whether any settle reported more than it was counted with (an overrun).
    overran: bool = False


@dataclass
class Walk:
    """One key, walked on Redis and on the model at once, with the truth kept beside."""

    store: RedisStore
    clock: FakeClock
    algorithm: str
    names: tuple[str, ...]
    rng: random.Random
    concurrency: int = 0
    #: The concurrency is a scope's, shared: the key holds the cap the walk writes as the
    #: sharer would (0 to K, or none), KEYS[8].
    shared: bool = False
    model: KeyModel = field(init=False)
    key: str = field(init=False)
    history: list[str] = field(default_factory=list)
    #: Rates in force (a live limit replaces them, keeping each window's field).
    rates: tuple[Rate, ...] = field(init=False)
    fields_: tuple[str, ...] = field(init=False)
    paused_until: int = 0
    #: Tickets released and not started (ticket -> [released at, acked, granted start]).
    tickets: dict[str, list[Any]] = field(default_factory=dict)
    #: Holders of running bodies with a slot.
    holders: list[str] = field(default_factory=list)
    #: Starts of this epoch (a reset of the windows forgets, on purpose), and all.
    starts: list[Start] = field(default_factory=list)
    eras: list[list[Start]] = field(default_factory=lambda: [[]])
    #: The rates in force in each era (a reset or a change of limit starts one).
    era_rates: list[tuple[Rate, ...]] = field(default_factory=list)
    #: (start, its Start, epoch) a settle may adjust.
    settleable: list[tuple[int, int, int, Start]] = field(default_factory=list)
    #: Entries that joined a line, and how each ended.
    joined: set[str] = field(default_factory=set)
    ended: Counter[str] = field(default_factory=Counter)
    started_tickets: Counter[str] = field(default_factory=Counter)
    refunds_only: bool = True
    #: What the walk saw: each kind of outcome, to fail a walk that tested nothing.
    seen: Counter[str] = field(default_factory=Counter)
    endings: dict[str, list[str]] = field(default_factory=dict)
    #: The start each ticket was granted ahead (RUN_AT), until it is used or given back.
    grants: dict[str, Start] = field(default_factory=dict)
    #: When the key's last call said it next needs a look (where a releaser goes next).
    last_due: int = 0

    def __post_init__(self) -> None:
        # (Which tickets a release acks first: draws of their own, from the walk's state,
        # so that the walk's own draws, and what each seed covers, stay as they were. The
        # state's ints alone: its last item may be None, whose hash before Python 3.12 is
        # its address, a walk of its own each run.)
        self.sent_rng = random.Random(hash(self.rng.getstate()[1]))
        # (The index's wake-ups, settles and the calls' controls read at: draws of their own too.)
        self.index_rng = random.Random(hash(self.rng.getstate()[1]) + 1)
        self.key = state_key(self.store.prefix, "walk", f"{self.rng.getrandbits(32):08x}")
        self.model = KeyModel(self.algorithm, policy=self.store.policy, layout=self.store.layout)
        self.model.writes_index = self.store.index_parts == 1
        self.rates = tuple(parse_rate(n) for n in self.names)
        self.era_rates = [self.rates]
        self.fields_ = tuple(rate_field(self.algorithm, r) for r in self.rates)

    # -- one call on both -------------------------------------------------------------------
    @property
    def slack(self) -> int:
        shortest = min((r.period_us for r in self.rates), default=1_000_000)
        return min(max(shortest // 100, 2000), 20_000)

    def costs(self, plain: int, tokens: int | None = None) -> tuple[int, ...]:
        """A cost per rate: ``tokens`` of a rate of tokens, ``plain`` of any other."""
        return tuple((tokens if tokens is not None and r.unit == "tokens" else plain) for r in self.rates)

    def calls(self, costs: tuple[int, ...], read: int = 0) -> tuple[WindowCall, Call]:
        uniform = len(set(costs)) <= 1
        cost: Any = costs[0] if uniform and costs else (tuple(costs) if costs else 1)
        lead = min(4 * self.slack, 500_000)
        wcall = WindowCall(self.algorithm, self.rates, cost, self.fields_, slack_us=self.slack,
                           not_before_us=self.paused_until, concurrency=self.concurrency,
                           slot_lease_us=3_000_000, lead_us=lead, shared=self.shared, read_us=read)
        mcall = Call(tuple((r.limit, r.period_us, r.unit) for r in self.rates), self.fields_,
                     costs if costs else (1,) * 0, uniform, self.slack, self.paused_until, self.concurrency,
                     3_000_000, lead, self.shared, read)
        return wcall, mcall

    def read_at(self) -> int:
        """When the walk's process read the controls a call is made under: unknown, now, or
        just before (or at) the key's last wake-up in the index."""
        woken = self.model.woken or 0
        return self.index_rng.choice([0, self.clock.now, max(woken - 1, 0), woken])

    def index_turn(self, op: str, got: WindowReply, read: int) -> None:
        """What a releaser and an operator do to the key's place in the index between its
        calls: a wake-up (a resume, a raised limit), and the settle of a release."""
        now = self.clock.now
        if op == "release" and self.index_rng.random() < 0.6:
            # (now and then from a clock a millisecond ahead: a releaser that read another
            # server's, or a failover's, clock; the key's next calls come before it)
            at = got.now_us + self.index_rng.choice([0, 0, 0, 1_000])
            self.store.index_settle([(self.key, 0, got.due_us, at, read)])
            self.model.settle_index(now, got.due_us, at, read)
            self.history.append(f"index settle due={got.due_us} at={at} read={read}")
            self.seen["index settled"] += 1
        if self.index_rng.random() < 0.04:
            self.store.index_wake([self.key])
            self.model.wake_index(now)
            self.history.append("index wake")
            self.seen["index woken"] += 1

    def run(self, op: str, costs: tuple[int, ...], *args: Any, delta: tuple[int, ...] | None = None) -> WindowReply:
        read = self.read_at()
        wcall, mcall = self.calls(costs, read)
        before = self._line_places()
        ends = (self.model.first_place, self.model.last_place)
        now = self.clock.now
        cost_arg: Any = None
        if delta is not None:
            cost_arg = delta[0] if len(set(delta)) == 1 else tuple(delta)
        got = self.store.window(self.key, op, wcall, *args, cost=cost_arg)
        self._keep_alive()
        want = self.model.run(now, op, mcall, *args, delta=delta)
        self.history.append(f"{op} {costs} {args if op not in ('acquire', 'admit', 'screen', 'front') else args[:4]}"
                            f" delta={delta} K={self.concurrency} paused={self.paused_until} at {now} -> "
                            f"{_show(got)}")
        assert _as_tuple(got) == _model_tuple(want), self.explain(
            f"script {_as_tuple(got)}\nmodel  {_model_tuple(want)}")
        self.check_stored()
        self.index_turn(op, got, read)
        self.check_index()
        both = set(self.model.line) & set(self.model.out)
        assert not both, self.explain(f"{op}: in the line and out at once: {both}")
        self.check_line_order(before, ends, got, op, args)
        self.check_conservation(op, args, got)
        if got.due_us:
            self.last_due = got.due_us
        return got

    def explain(self, what: str) -> str:
        return f"{what}\n{self.algorithm} {self.names} K={self.concurrency}; last steps:\n" + "\n".join(
            self.history[-int(os.environ.get("CT_HISTORY", "25")):])

    # -- stored state -----------------------------------------------------------------------
    def check_stored(self) -> None:
        client, m = self.store._redis, self.model
        state, lm, line, msgs, out, slots, used = window_keys(self.key)
        stored = {k.decode(): v for k, v in client.hgetall(state).items()}
        assert stored.get("e") == (str(m.epoch).encode() if m.epoch is not None else None), self.explain("epoch")
        if m.delay is not None:
            assert (int(stored["d"]), int(stored["v"])) == (m.delay, m.jitter), self.explain("learnt delay")
        now = self.clock.now
        for name, r in m.windows.items():
            value = stored.get(name)
            live = r.live(r.decode(value), now) if value else []
            assert live == r.entries(), self.explain(f"window {name}: stored {live}, model {r.entries()}")
        if m.counts_lost:
            assert not client.exists(lm), self.explain("line counts back without a call that writes")
        elif m.waiting or m.out_count:
            raw = {k.decode(): v for k, v in client.hgetall(lm).items()}
            got = (int(raw["q"]), int(raw["s"]), int(raw["b"]), _map(raw["o"]), _map(raw["u"]), int(raw["c"]),
                   int(raw["x"]), int(raw["xt"]))
            want = (m.waiting, m.last_place, m.first_place, m.out_units, m.line_units, m.out_count, m.indexed,
                    m.indexed_at)
            assert got == want, self.explain(f"line counts: stored {got}, model {want}")
        else:
            assert not client.exists(lm), self.explain("line counts left behind")
        assert _zset(client, line) == m.line, self.explain(f"line: {_zset(client, line)} vs {m.line}")
        assert _zset(client, out) == m.out, self.explain(f"out: {_zset(client, out)} vs {m.out}")
        assert _zset(client, slots) == m.slots, self.explain(f"slots: {_zset(client, slots)} vs {m.slots}")
        assert _zset(client, used) == m.used, self.explain(f"used: {_zset(client, used)} vs {m.used}")
        raw_msgs = {k.decode(): v for k, v in client.hgetall(msgs).items()}
        metas = {k[:-1]: msgpack.unpackb(v) for k, v in raw_msgs.items() if k.endswith("#")}
        bodies = {k: v for k, v in raw_msgs.items() if not k.endswith("#")}
        assert bodies == m.messages, self.explain(f"messages: {sorted(bodies)} vs {sorted(m.messages)}")
        assert metas == {k: v.stored() for k, v in m.meta.items()}, self.explain(
            f"entries: {metas} vs { {k: v.stored() for k, v in m.meta.items()} }")

    def check_index(self) -> None:
        """The key's place in the index of lines, its wake-up stamps and the releasers'
        wake-ups pushed are the model's (then the wake-ups are cleared on both)."""
        client, m = self.store._redis, self.model
        index, at = self.store.index_keys(0)
        score = client.zscore(index, self.key)
        stamps = client.hmget(at, self.key, self.key + "#w")
        got = (None if score is None else int(score), *(None if v is None else int(v) for v in stamps))
        assert got == (m.index_due, m.index_at, m.woken), self.explain(
            f"index: stored {got}, model {(m.index_due, m.index_at, m.woken)}")
        wakes = [v.decode() for v in reversed(client.lrange(wake_key(self.store.prefix), 0, -1))]
        assert wakes == m.wakes, self.explain(f"wake-ups: pushed {wakes}, model {m.wakes}")
        if wakes:
            self.seen["releaser woken"] += 1
        client.delete(wake_key(self.store.prefix))
        m.wakes = []

    # -- properties -------------------------------------------------------------------------
    def _line_places(self) -> dict[str, int]:
        """Where every entry known before a call stands (or would stand, put back): the
        line, and the places of those out."""
        return {**{i: m.place for i, m in self.model.meta.items()}, **self.model.line}

    def check_line_order(self, before: dict[str, int], ends: tuple[int, int], got: WindowReply, op: str,
                         args: tuple[Any, ...]) -> None:
        """What left the line in this call (released, expired, lost) was its head, in order.
        ``ends``: the line's first and last places before the call."""
        left = [r.id for r in got.reported if r.kind in ("r", "x", "c", "l")]
        if op in ("acquire", "screen", "admit", "front"):
            # (the call's own task, expired as it arrives, leaves at once: not from the head)
            own = args[3] if op in ("acquire", "screen") else args[0]
            left = [i for i in left if not (i == own and any(r.id == own and r.kind == "x" for r in got.reported))]
        if not left or op == "renew":  # (renew's 'l': holders whose lease ran out)
            return
        places = dict(before)
        # (the entry this call put in the line, if it left again at once: the place it
        # took, one past an end as the call found them; a line emptied by the call starts
        # its places afresh)
        if op in ("acquire", "screen", "admit", "front"):
            joined = args[3] if op in ("acquire", "screen") else args[0]
            urgency = args[10] if op in ("acquire", "screen") else args[7]
            places.setdefault(joined, ends[0] - 1 if op == "front" else self.model._place_of(ends[1] + 1, urgency))
        places.update(self.model.line)
        for r in got.reported:
            meta = self.model.meta.get(r.id)
            if meta is not None:
                places[r.id] = meta.place
        arriving = args[0] if op == "claim" else args[3] if op == "acquire" else None  # (a pending copy's entry)
        if arriving is not None and places.get(arriving) == 0:
            places[arriving] = -(2**62)  # (released at publish, put back before everyone)
        candidates = sorted((p, i.encode()) for i, p in places.items() if i in set(left) | set(self.model.line))
        order = [i.decode() for _, i in candidates]
        assert order[:len(left)] == left, self.explain(
            f"{op} {args[:6]}: left the line {left}, its head was {order[:len(left)]} (places {places})")

    def check_conservation(self, op: str, args: tuple[Any, ...], got: WindowReply) -> None:
        """A head that fits within the lead was released, unless the call's batch ran out;
        and the key's next look is no later than when its head fits."""
        m = self.model
        if op in ("peek", "ack", "renew", "take_back") or m.waiting == 0 or got.code in (Code.TOO_COSTLY, Code.STALE):
            return  # (STALE: nothing done; the claim that follows at once looks)
        if self.paused_until > self.clock.now or not m._slot_free():
            return
        head = min(m.line, key=lambda e: (m.line[e], e.encode()))
        meta = m.meta[head]
        if 0 < meta.expires <= self.clock.now or any(u > r.limit for u, r in zip(m._units_of(meta), m.rates)):
            return
        fit = m._earliest(self.clock.now, m._units_of(meta), m._out_per_rate())
        if fit is None:
            return
        batch = args[{"release": 0, "drain": 0, "give_back": 1, "ended": 1, "settle": 3, "claim": 9}.get(op, -3)]  # (-3: an entry's batch, before its lost holder and urgency)
        looked = sum(1 for r in got.reported if r.kind in ("r", "x", "c", "l"))
        if fit <= self.clock.now + m.lead():
            assert looked >= batch, self.explain(f"head {head} fits at {fit} (lead {m.lead()}), not released")
        assert got.due_us <= max(fit - m.lead(), self.clock.now), self.explain(
            f"next look {got.due_us}, but the head fits at {fit}")

    def take_back(self, ticket: str) -> None:
        """The start granted to ``ticket`` was given back (its process woke too late, it
        waited past its max wait, it was discarded): it never happened."""
        if self.started_tickets[ticket] > 0:
            self.started_tickets[ticket] -= 1
        start = self.grants.pop(ticket, None)
        if start is not None:
            for table in (self.starts, *self.eras):
                if start in table:
                    table.remove(start)
            self.settleable = [s for s in self.settleable if s[3] is not start]

    def out_before(self, got: WindowReply) -> list[int]:
        """Units per rate of the tasks out after a call that were out before it (not those
        it released itself, after its own start, into the room left)."""
        m = self.model
        out = m._out_per_rate()
        for r in got.reported:
            if r.kind == "r" and r.id in m.meta:
                out = [o - u for o, u in zip(out, m._units_of(m.meta[r.id]))]
        return out

    def note_start(self, at: int, latest: int, units: list[int], counted: tuple[int, int, int],
                   beside: list[int] | None = None) -> Start:
        """A body starts in [at, latest]: the units known now of every start in its
        window, and its own, fit every rate; and (``beside``, a released task's start:
        the units of the others released and not started, per rate) the room they were
        released into is still theirs: a released task does not take another's start."""
        for i, r in enumerate(self.rates):
            for edge in (at, latest):
                if self.algorithm == "sliding":
                    inside = [s for s in self.starts if s.latest > edge - r.period_us and s.at <= edge]
                else:
                    k = edge // r.period_us
                    inside = [s for s in self.starts if s.at // r.period_us <= k <= s.latest // r.period_us]
                total = sum(s.units[i] for s in inside) + units[i]
                assert total <= r.limit, self.explain(
                    f"a start at {edge} makes {total} units of {r} in its window: "
                    f"{[(s.at, s.latest, s.units) for s in inside]}; windows "
                    f"{ {n: w.entries() for n, w in self.model.windows.items()} }")
                if beside is not None and edge == at:
                    assert total + beside[i] <= r.limit, self.explain(
                        f"a released task's start at {at} makes {total} units of {r} in its window, with "
                        f"{beside[i]} out beside it: it took the room of those released before it")
        start = Start(at, latest, list(units))
        self.starts.append(start)
        self.eras[-1].append(start)
        self.settleable.append((*counted, start))  # type: ignore[arg-type]
        self.seen["start"] += 1
        return start

    def check_truth(self) -> None:
        """With refunds alone, no window ever held more than its limit of reported units."""
        if not self.refunds_only:
            return
        for era, rates in zip(self.eras, self.era_rates, strict=True):
            for i, r in enumerate(rates):
                for edge in ("at", "latest"):
                    units = [(getattr(s, edge), s.units[i]) for s in era]
                    most = (max_units_in_any_interval(units, r.period_us) if self.algorithm == "sliding"
                            else max_units_per_aligned_window(units, r.period_us))
                    assert most <= r.limit, self.explain(f"{most} reported units of {r} in a window")

    # -- what the walk does -------------------------------------------------------------------
    def new_id(self, kind: str) -> str:
        """An id the walk's seed makes (a walk is the same walk every run)."""
        return f"{kind}{self.rng.getrandbits(24):06x}:{self.rng.getrandbits(32):08x}"

    def end(self, entry: str, why: str, count: int = 1) -> None:
        self.ended[entry] += count
        self.endings.setdefault(entry, []).append(f"{why} at {self.clock.now}")

    def settle_out(self, got: WindowReply) -> None:
        """Account what a reply says: tickets released, bodies started, tasks reported (a
        ticket no longer out, its task put back in the line, is forgotten)."""
        for ticket in [t for t in self.tickets if t not in self.model.out]:
            del self.tickets[ticket]
        for r in got.reported:
            if r.kind == "r":
                self.tickets[r.id] = [self.clock.now, False, 0]
                self.seen["released"] += 1
            elif r.kind in ("x", "c", "l", "f", "k"):
                self.tickets.pop(r.id, None)
                self.end(r.id, f"reported {r.kind}")
                self.seen[f"reported {r.kind}"] += 1

    def urgency(self) -> int:
        """A task's priority: mostly its broker's default, else a few levels ahead or behind."""
        return self.rng.choice([0, 0, 0, 0, 0, 0, 1, 2, -1, 3])

    def fresh(self, runs: bool = True, message: bool = True, op: str = "acquire", **entry: Any) -> WindowReply:
        plain = self.rng.choice([1, 1, 1, 2, 3])
        costs = self.costs(plain, self.rng.choice([5, 10, 25]))
        eid, holder = self.new_id("t"), self.new_id("h")
        expires = self.clock.now + self.rng.choice([0, 0, 0, 200_000, 2_000_000]) if entry.get("expiring") else 0
        max_wait = self.rng.choice([0, 0, 500_000, 3_000_000])
        args: tuple[Any, ...] = (eid, b"m-" + eid.encode() if message else b"", "task-" + eid, expires, max_wait,
                                 self.rng.choice([1, 2, 8]), "", self.urgency())
        if op in ("acquire", "screen"):
            # (a lease of the call's own cost is none; a long span crosses fixed windows)
            args = (self.rng.choice([0, 0, 1, 2, 4, 16]), self.rng.choice([0, 50_000, 400_000]), holder, *args)
        got = self.run(op, costs, *args)
        self.settle_out(got)
        if got.code == Code.QUEUED:
            self.joined.add(eid)
            self.seen["queued"] += 1
        elif got.code == Code.RUN and op == "acquire":
            span = max(self.slack, args[1]) if got.leased else self.slack  # (the lease span asked)
            # (a lease is of `leased` units of every rate for a call of one cost, else of
            # `leased` calls like this one)
            uniform = len(set(costs)) == 1
            units = ([got.leased] * len(costs) if uniform else [c * got.leased for c in costs]) if got.leased \
                else list(costs)
            self.note_start(self.clock.now, self.clock.now + span, units, (self.clock.now, self.clock.now + span,
                                                                             got.epoch))
            if got.held:
                self.holders.append(holder)
        elif got.code == Code.RELEASED:
            self.tickets[eid] = [self.clock.now, True, 0]
            self.joined.add(eid)
            self.seen["released at publish"] += 1
        return got

    def claim(self, ticket: str, granted: int = 0, copied: bool = False, pending: bool = False,
              lose: bool = False, lost_by: str = "", message_now: bool = False) -> WindowReply:
        """The task released with ``ticket`` arrives (``granted``: its process woke too late
        for the start granted to it; ``copied``: a copy of its message), or (``pending``) a
        copy of it that names its entry, sent as a fresh call (a producer whose admit
        released it and whose reply was lost): that task arriving all the same. ``lose``:
        its reply is lost (a start it was given never ran: its copy comes next, naming
        this delivery in ``lost_by``; a start granted ahead is then given back by it, as
        by a process woken too late)."""
        holder, eid = self.new_id("h"), self.new_id("t")
        if lost_by:  # (a copy sent again keeps its holder's nonce)
            holder = f"{holder.rsplit(':', 1)[0]}:{lost_by}"
        sent_granted = 0 if lost_by else granted
        meta = self.model.meta.get(ticket)
        costs = tuple(meta.units.get(u, 1) for u in _units(self.names)) if meta else self.costs(1, 5)
        message = b"m-" + ticket.encode() if message_now else self.rng.choice([b"", b"m-" + ticket.encode()])
        if pending:
            args: tuple[Any, ...] = (0, 0, holder, ticket, message, "task", 0, self.rng.choice([0, 0, 2_000_000]),
                                     self.rng.choice([1, 4]), lost_by, self.urgency())
        else:
            args = (ticket, self.rng.choice([1_000_000, 20_000]), holder, sent_granted, eid, message, "task", 0,
                    self.rng.choice([0, 0, 2_000_000]), self.rng.choice([1, 4]), lost_by, self.urgency(),
                    self.rng.choice(["0", "1"]))
        # (a copy after a lost reply: the task itself, which ran nothing)
        known = (ticket in self.tickets or bool(lost_by)) and not copied
        # (its process woke past the grant's keep: the store forgot the grant; it started
        # nothing, and must not be dropped as a copy of a task that started)
        late = bool(granted) and 0 < self.model.out.get(ticket, 0) <= self.clock.now
        got = self.run("acquire" if pending else "claim", costs, *args)
        if late:
            assert got.code != Code.DUPLICATE, self.explain(f"{ticket}, woken late for its grant, was dropped")
            self.seen["late grant"] += 1
        if lost_by:
            assert got.code != Code.DUPLICATE, self.explain(f"{ticket}, whose start's reply was lost, was dropped")
            self.seen["lost reply"] += 1
            if got.code == Code.DENIED:  # (told without its message: it calls again with it, as the hook does)
                self.settle_out(got)
                return self.claim(ticket, granted, lost_by=lost_by, message_now=True)
        forgotten = any(r.id == ticket and r.kind == "f" for r in got.reported)
        if forgotten:
            known = False  # (its time was up: it came back as a new task)
        self.settle_out(got)
        if forgotten and pending:
            # (the copy names the entry the store just forgot: it is a new task under that
            # entry's id, whose life begins here)
            self.ended[ticket], self.endings[ticket] = 0, []
        if known and granted:
            self.end(ticket, "granted start given back", -1)  # (this claim decides)
            self.take_back(ticket)
        if got.code in (Code.RUN, Code.RUN_AT):
            if got.start_us == 0:  # (a fresh call: counted at now)
                start = self.note_start(self.clock.now, self.clock.now + self.slack, list(costs),
                                        (self.clock.now, self.clock.now + self.slack, got.epoch))
            else:
                start = self.note_start(got.start_us, got.latest_us, list(costs),
                                        (got.start_us, got.latest_us, got.epoch),
                                        beside=self.out_before(got) if known and not granted else None)
            if known:
                self.started_tickets[ticket] += 0 if granted else 1
                self.tickets.pop(ticket, None)
                if got.code == Code.RUN_AT:
                    self.tickets[ticket] = [self.clock.now, True, got.start_us]
                    self.grants[ticket] = start
                    self.seen["granted"] += 1
                self.end(ticket, Code(got.code).name)
            elif copied and got.code == Code.RUN_AT:
                # (a copy of its message granted the ticket's start: a give-back of the
                # ticket takes that start back, whoever holds it)
                self.grants[ticket] = start
            if lose and known:
                # (the store error, the re-send: now and then past a start's keep, when the
                # store has forgotten the start granted to the delivery that lost its reply)
                keep = max(got.start_us - self.clock.now, 0) + self.model.policy.grant_keep_ms * 1000 + 3 * self.slack
                self.advance(self.rng.choice([0, 0, 3 * self.slack, keep]))
                nonce = holder.rsplit(":", 1)[1]
                if got.code == Code.RUN_AT:
                    self.tickets.pop(ticket, None)  # (nobody else claims it: its copy comes next)
                    return self.claim(ticket, granted=got.start_us, lost_by=nonce)
                # (its body never ran: the copy decides)
                self.started_tickets[ticket] -= 0 if granted else 1
                self.end(ticket, "reply lost", -1)
                return self.claim(ticket, lost_by=nonce)
            if got.held:
                self.holders.append(holder)
        elif got.code == Code.QUEUED and known:
            if not any(r.id == ticket and r.kind == "r" for r in got.reported):  # (not released again at once)
                self.tickets.pop(ticket, None)
            self.seen["back in line"] += 1
        elif got.code == Code.DUPLICATE:
            self.seen["duplicate"] += 1
        elif got.code == Code.STALE:
            # (released under other controls: nothing done; its process claims again)
            # (out, or put back in its place before it came: the task itself, all the same)
            assert ticket in self.model.out or ticket in self.model.line, self.explain(
                f"STALE for {ticket}, neither out nor in line")
            self.seen["stale"] += 1
        elif got.code in (Code.WAITED, Code.TOO_COSTLY) and known and ticket not in self.model.out:
            # (a copy's own cost over a limit is refused before its entry is looked at)
            self.tickets.pop(ticket, None)
            self.end(ticket, Code(got.code).name)
            self.seen["waited"] += 1
        elif known and granted:
            self.tickets.pop(ticket, None)  # (given back, not let in again: it waits in its process)
        return got

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        shortest = min((r.period_us for r in self.rates), default=1_000_000)
        if roll < 0.22:
            self.fresh(op=rng.choice(["acquire", "acquire", "screen", "admit"]), message=rng.random() < 0.8,
                       expiring=rng.random() < 0.2)
        elif roll < 0.27:
            self.fresh(op="front", expiring=False)
        elif roll < 0.45 and self.tickets:
            ticket = rng.choice(sorted(self.tickets))
            _released, acked, granted = self.tickets[ticket]
            if not acked and rng.random() < 0.7:
                got = self.run("ack", self.costs(1, 5), ticket)
                self.settle_out(got)
                self.tickets[ticket][1] = True
            elif granted:
                if rng.random() < 0.5:
                    # (the process it was granted to woke too late for it: even, now and
                    # then, past the grant's keep, when the store has forgotten it)
                    keep = max(granted - self.clock.now, 0) + self.model.policy.grant_keep_ms * 1000 + 3 * self.slack
                    self.advance(rng.choice([0, self.slack * 3, keep]))
                    self.claim(ticket, granted=granted)
                else:
                    self.claim(ticket, copied=True)  # (a copy of its message: no proof)
            else:
                self.claim(ticket)
        elif roll < 0.5 and self.tickets:
            # A copy of a released task's message, of one that started (dropped), or a
            # guess: checked as a fresh call.
            roll2 = rng.random()
            if roll2 < 0.5:
                ticket = rng.choice(sorted(self.tickets))
            elif roll2 < 0.8 and self.model.used:
                ticket = rng.choice(sorted(self.model.used))
            else:
                ticket = self.new_id("forged")
            self.claim(ticket, copied=True)
            self.seen["copied"] += 1
        elif roll < 0.52 and self.tickets:
            # A copy of a released task sent as a fresh call naming its entry (pending).
            ticket = rng.choice(sorted(self.tickets))
            self.claim(ticket, pending=True)
            self.seen["pending copy"] += 1
        elif roll < 0.54 and self.tickets:
            # A released task's claim whose reply is lost, and its copy sent again.
            ticket = rng.choice(sorted(self.tickets))
            granted = self.tickets[ticket][2]
            if not granted:
                self.claim(ticket, lose=True)
            else:  # (granted ahead, its reply came: its process wakes past the grant's keep)
                self.advance(max(granted - self.clock.now, 0) + self.model.policy.grant_keep_ms * 1000
                             + 3 * self.slack)
                self.claim(ticket, granted=granted)
        elif roll < 0.6:
            if rng.random() < 0.5 and self.clock.now < self.last_due < self.clock.now + 10 * shortest:
                self.advance(self.last_due - self.clock.now)  # (as a releaser does)
            # (the tickets the releaser sent since its last release of the key, acked first)
            # (in a third of the releases: the walk's own acks, and the grants woken late that
            # need a ticket never acked, stay as common as the seeds made them)
            piggyback = self.sent_rng.random() < 1 / 3
            sent = sorted(t for t, (_, acked, _) in self.tickets.items()
                          if piggyback and not acked and self.sent_rng.random() < 0.5)
            got = self.run("release", self.costs(1, 5), rng.choice([1, 2, 64]), *sent)
            for ticket in sent:
                if ticket in self.tickets:
                    self.tickets[ticket][1] = True
            self.settle_out(got)
            if got.reported and rng.random() < 0.5:  # (their arrival, a dispatch later)
                self.advance(rng.choice([0, 200, self.slack // 2]))
                for r in got.reported:
                    if r.kind == "r" and r.id in self.tickets:
                        self.claim(r.id)
        elif roll < 0.605 and (self.tickets or self.model.line):
            # The journal says these left their lines for good (sent), and the store holds
            # them again (a failover to a replica short of their release): a released
            # ticket (out: left alone once acked, granted or started), a waiting entry (it
            # leaves, reported), or one the store does not know.
            picks = sorted(set(rng.sample(sorted(self.tickets), min(len(self.tickets), 2))) | set(
                rng.sample(sorted(self.model.line), min(len(self.model.line), 1))))
            picks.append(self.new_id("gone"))
            got = self.run("take_back", self.costs(1, 5), rng.randint(0, len(picks)), *picks)
            assert {r.id for r in got.reported} <= set(picks), self.explain("took back what it was not given")
            self.settle_out(got)
            self.seen["taken back"] += len(got.reported)
        elif roll < 0.63 and self.tickets:
            ticket = rng.choice(sorted(self.tickets))
            # (one whose time is up is put back, forgotten or done by the call's own look first)
            was_out = self.model.out.get(ticket, 0) > self.clock.now
            meta = self.model.meta.get(ticket)
            # (handed back: a worker with no process for it puts one never acked back in its
            # place, and leaves any other as it is)
            handed_back = rng.random() < 0.5
            unacked = was_out and meta is not None and meta.phase == "s" and ticket in self.model.messages
            if was_out and meta is not None and (meta.phase != "g" or self.clock.now < meta.start) and (
                    not handed_back or unacked):
                if meta.phase == "g":
                    self.end(ticket, "granted start given back", -1)
                self.take_back(ticket)
            got = self.run("give_back", self.costs(1, 5), ticket, rng.choice([1, 8]), "1" if handed_back else "0")
            reported = {r.id for r in got.reported}
            if handed_back and unacked:
                self.seen["handed back"] += 1
            self.settle_out(got)
            if was_out and ticket not in reported and ticket not in self.model.line and ticket not in self.model.out:
                self.tickets.pop(ticket, None)
                self.end(ticket, "given back")
                self.seen["given back"] += 1
        elif roll < 0.7 and self.settleable and self.rates:
            # (a body that ran reports its cost: not one whose granted start its process may
            # still give back)
            granted = [id(g) for g in self.grants.values()]
            choices = [s for s in self.settleable if id(s[3]) not in granted] or [None]
            picked = rng.choice(choices)
            if picked is None:
                return
            at, latest, epoch, start = picked
            delta = tuple(rng.choice([-2, -1, 0, 1, 3]) if rng.random() < 0.8 else -u for u in start.units)
            delta = tuple(max(d, -u) for d, u in zip(delta, start.units))
            if any(d > 0 for d in delta):
                self.refunds_only = False
            got = self.run("settle", self.costs(1, 5), at, latest, str(epoch), rng.choice([1, 8]), delta=delta)
            self.settle_out(got)
            if self.model.epoch is not None and str(self.model.epoch) == str(epoch):
                start.units = [u + d if latest + r.period_us > self.clock.now else u
                               for u, d, r in zip(start.units, delta, self.rates)]
            self.seen["settled"] += 1
        elif roll < 0.75 and self.holders:
            holder = self.holders.pop(rng.randrange(len(self.holders)))
            got = self.run("ended", self.costs(1, 5), holder, rng.choice([1, 8]))
            self.settle_out(got)
            self.seen["slot given back"] += 1
        elif roll < 0.77 and self.holders:
            got = self.run("renew", self.costs(1, 5), *rng.sample(self.holders, min(2, len(self.holders))))
            self.settle_out(got)
        elif roll < 0.79:
            self.paused_until = self.clock.now + rng.choice([shortest, 3 * shortest]) if rng.random() < 0.5 else 0
            self.seen["pause"] += 1
        elif roll < 0.81 and self.rates:
            # A live limit: each window keeps its field, under another limit.
            self.rates = tuple(Rate(max(1, r.limit + rng.choice([-2, 3, 10])), r.period, r.unit)
                               for r in parse_rates_of(self.names))
            # (the truth is checked per era of one limit: starts under the limit before
            # and after are each checked at their start, against what the windows held)
            self.eras.append([])
            self.era_rates.append(self.rates)
            self.seen["live limit"] += 1
        elif roll < 0.82 and (self.concurrency or self.seen["K lifted"]):
            if self.shared and rng.random() < 0.8:
                self.share(rng.choice([0, 1, 2, 3, None]))  # (the sharer moves the cap, or it ran out)
            else:
                # (lifted, where rates remain: the slots held go on to their ends, unlimited)
                lift = self.rates and not self.shared and self.concurrency and rng.random() < 0.5
                self.concurrency = 0 if lift else rng.choice([1, 2, 3])
                if self.concurrency == 0:
                    self.seen["K lifted"] += 1
        elif roll < 0.83:
            self.store.delete(self.key)
            self.model.reset_windows()
            self.eras.append([])
            self.era_rates.append(self.rates)
            self.starts = []
            self.settleable = []
            self.grants = {}  # (starts granted before: nothing of them is given back now)
            self.advance(1)
            self.seen["reset"] += 1
        elif roll < 0.835:
            # The line's counts evicted (allkeys-lru takes one key of a line), its entries
            # staying: the next call counts them again.
            lm = window_keys(self.key)[1]
            if self.store._redis.delete(lm):
                self.model.lose_counts()
                self.seen["counts evicted"] += 1
        elif roll < 0.85:
            got = self.run("peek", self.costs(1, 5))
        elif roll < 0.86:
            got = self.run("drain", self.costs(1, 5), rng.choice([1, 3]))
            self.settle_out(got)
        else:
            self.advance(rng.choice([1, 500, self.slack, shortest // 7, shortest // 2, shortest, 3 * shortest,
                                     self.store.policy.out_lease_ms * 1000 + 1]
                                    if rng.random() < 0.97 else [40 * shortest]))

    def share(self, cap: int | None) -> None:
        """The sharer writes the key's cap (None: the cap ran out, or the key left)."""
        if cap is None:
            self.store._redis.delete(share_key(self.key))
        else:
            self.store._redis.set(share_key(self.key), cap)
        self.model.share_cap = cap or 0
        self.history.append(f"share cap {cap}")
        self.seen["share cap moved"] += 1

    def _keep_alive(self) -> None:
        """Keep Redis's own TTLs (real milliseconds, from a test clock's spans) from
        expiring the walk's keys between two of its calls on a slow machine: after every
        call, not every step (a step's loops make many calls)."""
        names = window_keys(self.key)
        pipe = self.store._redis.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
        ttls = pipe.execute()
        for name, ttl in zip(names, ttls, strict=True):
            if 0 <= ttl < 600_000:
                pipe.pexpire(name, 600_000)
        pipe.execute()

    def advance(self, dt: int) -> None:
        self.clock.now += dt
        self.history.append(f"advance {dt} -> {self.clock.now}")

    def finish(self) -> None:
        """Let everything go: no pause, the declared limits (a head that costs more than a
        lowered live limit waits until the limit admits it), time for every window, every
        ticket claimed."""
        self.paused_until = 0
        if self.shared:
            self.share(self.concurrency)
        if self.rates != parse_rates_of(self.names):
            self.eras.append([])  # (a new era of one limit: see the live limit above)
            self.era_rates.append(parse_rates_of(self.names))
        self.rates = parse_rates_of(self.names)
        for _ in range(400):
            if not (self.model.waiting or self.model.out):
                break
            self.advance(max((r.period_us for r in self.rates), default=1_000_000))
            got = self.run("release", self.costs(1, 5), 64)
            self.settle_out(got)
            for ticket in sorted(self.tickets):
                if ticket not in self.tickets:
                    continue  # (its time was up meanwhile)
                if self.tickets[ticket][2]:
                    del self.tickets[ticket]  # (granted: its process ran it)
                else:
                    self.claim(ticket)
            for holder in list(self.holders):
                self.holders.remove(holder)
                self.settle_out(self.run("ended", self.costs(1, 5), holder, 64))
        assert not self.model.waiting, self.explain("tasks still waiting at the end")


def parse_rates_of(names: tuple[str, ...]) -> tuple[Rate, ...]:
    return tuple(parse_rate(n) for n in names)


def _holds(m: KeyModel) -> bool:
    return any(r.holds_units() for r in m.windows.values())


def _map(raw: bytes) -> dict[str, int]:
    flat = msgpack.unpackb(raw)
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)} if isinstance(flat, list) else {}


def _zset(client: redis.Redis, name: str) -> dict[str, float]:
    return {k.decode(): int(v) if v == int(v) else v for k, v in client.zrange(name, 0, -1, withscores=True)}


#: The reply's fields before the tasks reported, and where its rooms are (WindowReply's order).
_FIELDS, _ROOMS = len(REPLY_PLACES), WindowReply._fields.index("rooms")


def _as_tuple(reply: WindowReply) -> tuple[Any, ...]:
    return (*reply[:_FIELDS], tuple((r.id, r.payload, r.kind) for r in reply.reported))


def _model_tuple(reply: Any) -> tuple[Any, ...]:
    t = reply.as_tuple()
    rooms = tuple(int(v) for v in t[_ROOMS].split(",")) if t[_ROOMS] else ()
    reported = tuple((i, p.decode() if isinstance(p, bytes) and k not in ("r", "x", "c") else p, k)
                     for i, p, k in t[_FIELDS])
    return (*t[:_ROOMS], rooms, *t[_ROOMS + 1:_FIELDS], reported)


def _show(reply: WindowReply) -> str:
    return (f"{Code(reply.code).name} wait={reply.wait_us} q={reply.waiting} out={reply.out} run={reply.running} "
            f"due={reply.due_us} idx={reply.tell_index} start={reply.start_us} "
            f"reported={[(r.id[:12], r.kind) for r in reply.reported]}")


def run_walk(store: RedisStore, clock: FakeClock, algorithm: str, names: tuple[str, ...], seed: int,
          concurrency: int = 0, steps: int = STEPS, shared: bool = False) -> Walk:
    walk = Walk(store, clock, algorithm, names, random.Random(seed), concurrency=concurrency, shared=shared)
    if shared:
        walk.share(walk.rng.choice([0, 1, concurrency]))
    for _ in range(steps):
        walk.step()
    walk.finish()
    walk.check_truth()
    # Every task that joined a line ended once (started, reported, waited, given back).
    for entry in walk.joined:
        assert walk.ended[entry] <= 1, walk.explain(f"{entry} ended {walk.ended[entry]} times: "
                                                    f"{walk.endings[entry]}; " + "\n".join(
                                                        h for h in walk.history if entry[:12] in h))
    assert max(walk.started_tickets.values(), default=0) <= 1, walk.explain("a ticket started two bodies")
    return walk
