"""Shadow mode's operation (line.lua's ``shadow``), against its twin and against truth.

A throttle in shadow mode holds nothing: each call is given, on the key's shadow keys, the
start enforcing would have given it (first come, first served, at the earliest every rate
admits it, not before a pause's end), and is recorded there at that start. Random walks of
shadow calls, settles, slots ended and renewed, pauses and time run on the script and on
``tests.line_reference.KeyModel``: the replies and everything stored must agree. Beside
the twin: the starts it gives never fill a window past its limit, they come in the order
of the calls, and a call is held back exactly when its start is later than now (or every
slot was held).
"""

from __future__ import annotations

import random
import zlib

import pytest
import redis

from celery_throttle.core.keys import shadow_key, state_key, window_keys
from celery_throttle.core.protocol import Code, Counted, Entry, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.store.client import RedisStore
from tests.helpers import QUICK, STORE_URL
from tests.line_walk import FakeClock, Walk
from tests.reference import max_units_in_any_interval, max_units_per_aligned_window
from tests.script.conftest import BASE_US

RATE_SETS = {"one": ("5/s",), "two": ("3/s", "10/5s"), "tokens": ("5/s", "40 tokens/s"), "none": ()}
STEPS = 150 if QUICK else 400


def shadow_walk(store: RedisStore, clock: FakeClock, algorithm: str, names: tuple[str, ...], seed: int,
                concurrency: int) -> tuple[Walk, list[tuple[int, tuple[int, ...]]]]:
    """A walk of shadow calls on the script and the twin (Walk compares each reply and the
    stored windows, line and slots); returns it and the start of every call recorded."""
    rng = random.Random(seed)
    walk = Walk(store, clock, algorithm, names, rng, concurrency=concurrency)
    walk.key = shadow_key(walk.key)
    starts: list[tuple[int, tuple[int, ...]]] = []
    holders: list[str] = []
    for n in range(STEPS):
        roll = rng.random()
        costs = walk.costs(rng.choice([1, 1, 1, 2]), rng.choice([5, 10, 20]))
        if roll < 0.6:
            holder = f"h{n}:" if concurrency else ""
            max_wait = rng.choice([0, 0, 0, 2_000_000])
            got = walk.run("shadow", costs, holder, max_wait)
            if got.code == Code.TOO_COSTLY:
                continue
            later = got.start_us > clock.now
            full = concurrency > 0 and got.running >= concurrency
            assert (got.code != Code.RUN) == (later or full) or got.code == Code.TOO_FAR, walk.explain(
                "held back without cause, or run with one")
            assert got.wait_us == got.start_us - clock.now
            if got.code != Code.TOO_FAR and names:
                assert not starts or got.start_us >= starts[-1][0], walk.explain("a start before an earlier call's")
                starts.append((got.start_us, costs))
                if rng.random() < 0.3:  # (its body reports another cost)
                    delta = tuple(rng.choice([-1, 0, 1]) if c > 1 else 0 for c in costs)
                    if any(delta):
                        walk.run("settle", costs, got.start_us, got.latest_us, str(got.epoch), 8, delta=delta)
                        starts[-1] = (got.start_us, tuple(c + d for c, d in zip(costs, delta)))
            if got.held:
                holders.append(holder)
        elif roll < 0.7 and holders:
            walk.run("ended", costs, holders.pop(rng.randrange(len(holders))), 8)
        elif roll < 0.75 and holders:
            walk.run("renew", costs, *holders)
        elif roll < 0.78:
            walk.paused_until = clock.now + rng.randrange(3_000_000) if not walk.paused_until else 0
        else:
            walk.advance(rng.choice([1_000, 50_000, 200_000, 1_000_000]))
        m = walk.model
        raw = {k.decode(): int(v) for k, v in store._redis.hgetall(walk.key).items() if k.decode() in "lnhwm"}
        assert raw == {k: v for k, v in {"l": m.shadow_last, **m.shadow_counts}.items() if v or k in raw}, \
            walk.explain(f"shadow counts: stored {raw}, model {m.shadow_counts} last {m.shadow_last}")
    return walk, starts


@pytest.mark.parametrize("rate_set", sorted(RATE_SETS))
@pytest.mark.parametrize("algorithm", ["sliding", "fixed"])
def test_shadow_mode_gives_each_call_the_start_enforcing_would_and_holds_nothing(
    redis_client: redis.Redis, key_prefix: str, algorithm: str, rate_set: str
) -> None:
    # Given a key's shadow keys, walked at random with shadow calls (slots too, and alone)
    clock = FakeClock(BASE_US)
    store = RedisStore(STORE_URL, key_prefix, clock=clock)
    names = RATE_SETS[rate_set]
    try:
        for n in range(2):
            concurrency = 2 if not names or n else 0
            # When each runs on the script and on its twin
            walk, starts = shadow_walk(store, clock, algorithm, names, zlib.crc32(f"{algorithm}/{rate_set}/{n}".encode()),
                                       concurrency)
            # Then they agreed at every step (asserted as they walked), and the starts given
            # fill no window past its limit (less what bodies refunded)
            for i, rate in enumerate(walk.rates):
                units = [(at, costs[i]) for at, costs in starts]
                most = (max_units_in_any_interval(units, rate.period_us) if algorithm == "sliding"
                        else max_units_per_aligned_window(units, rate.period_us))
                assert most <= rate.limit + 1, f"{most} units of {rate} in one window"
            held = walk.model.shadow_counts["h"]
            assert held, "the walk never held anything back"
            # and nothing of the key's own: no line, no message, nothing out
            line, msgs, out = (window_keys(walk.key)[i] for i in (2, 3, 4))
            assert not store._redis.exists(line, msgs, out)
    finally:
        store.close()


def test_a_burst_in_shadow_mode_is_told_the_waits_a_line_would_have_had(store: RedisStore, key_prefix: str) -> None:
    # Given 12 calls at once of a key of 5/s in shadow mode
    key = shadow_key(state_key(key_prefix, "api", "acme"))
    call = WindowCall("sliding", (parse_rate("5/s"),), 1, slack_us=10_000)
    replies = [store.shadow(key, call, "", 0) for _ in range(12)]
    # Then 5 would have run now, 5 a window later and 2 two windows later; all run now
    waits = [round(r.wait_us / 1e6, 2) for r in replies]
    assert waits == [0.0] * 5 + [1.01] * 5 + [2.02] * 2, waits
    assert [r.code for r in replies] == [Code.RUN] * 5 + [Code.DENIED] * 7
    # and the key's own state holds nothing
    assert not store._redis.exists(*window_keys(state_key(key_prefix, "api", "acme")))
    # and a refund of the first call's unit makes room now, but a call after them goes
    # after them, as in a line (first come, first served)
    first = replies[0]
    store.settle(key, call, Counted(first.start_us, first.latest_us, 1, first.epoch), -1, 8)
    assert store.shadow(key, call, "", 0).wait_us == replies[-1].wait_us


def test_a_task_released_before_its_throttle_went_to_shadow_mode_gives_its_room_back_once(
    store: RedisStore, clock: FakeClock, key_prefix: str
) -> None:
    # Given a key of 1/s with a task that ran and one waiting in its line, released
    key = state_key(key_prefix, "api", "acme")
    call = WindowCall("sliding", (parse_rate("1/s"),), 1, slack_us=10_000)
    assert store.acquire(key, call, entry=Entry("first", b"m", "first")).code == Code.RUN
    assert store.acquire(key, call, entry=Entry("second", b"m2", "second")).code == Code.QUEUED
    clock.now += 1_100_000
    released = store.release(key, call, 8)
    assert [r.id for r in released.reported] == ["second"] and released.out == 1
    # When it arrives in shadow mode: it starts outside the rules
    given = store.give_back(key, call, "second", 8, shadowed=True)
    # Then its room comes back (nothing out, nothing waits), and a copy of its message,
    # delivered twice, is a DUPLICATE there and in a claim, as after any start
    assert given.code == Code.RUN and (given.out, given.waiting) == (0, 0)
    assert store.give_back(key, call, "second", 8, shadowed=True).code == Code.DUPLICATE
    assert store.claim(key, call, "second", early_us=0, holder="h").code == Code.DUPLICATE


@pytest.mark.parametrize("algorithm", ["sliding", "fixed"])
def test_giving_back_a_released_task_in_shadow_mode_matches_the_twin(
    store: RedisStore, clock: FakeClock, algorithm: str
) -> None:
    # Given a key of 2/s whose line is released (one task out, one granted its start ahead),
    # run on the script and its twin at once (Walk compares each reply and all it stores)
    walk = Walk(store, clock, algorithm, ("2/s",), random.Random(7))
    costs = walk.costs(1)
    for n in range(5):
        walk.run("acquire", costs, 0, 0, f"h{n}", f"e{n}", b"m", f"t{n}", 0, 0, 8, "", 0)
    walk.advance(1_050_000)
    out = [r.id for r in walk.run("release", costs, 8).reported]
    assert len(out) >= 2, out
    early = walk.run("claim", costs, out[1], 1_000_000, "hx", 0, "x", b"", "t", 0, 0, 8, "", 0, "0")
    # When each arrives in shadow mode (the one claimed early too: a copy of a task that
    # started, or one granted its start), then a copy of each, then a claim of a copy
    for ticket in (out[0], out[1], "never-released"):
        first = walk.run("give_back", costs, ticket, 8, "2")
        again = walk.run("give_back", costs, ticket, 8, "2")
        copy = walk.run("claim", costs, ticket, 1_000_000, "hy", 0, "y", b"", "t", 0, 0, 8, "", 0, "0")
        # Then (the twin agreeing at every step) the first gives its room back, unless it
        # had started (a copy: DUPLICATE), and every copy after it is a DUPLICATE
        started = ticket == out[1] and early.code == Code.RUN
        assert first.code == (Code.DUPLICATE if started else Code.RUN), (ticket, early)
        assert again.code == Code.DUPLICATE and copy.code == Code.DUPLICATE
