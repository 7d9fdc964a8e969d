"""slots.lua against its pure-Python twin (tests/slots_reference.py), operation by
operation, on a real Redis with a test clock: the same reply and the same state at every
step of random walks (tasks that take, queue, finish, die with their slot, never arrive
after a hand-over, renew), and the truths the model must keep: never more than the limit
holding a live slot, and slots handed over in the order the tasks first waited."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_throttle.keys import slot_keys, state_key
from celery_throttle.protocol import SlotCode
from celery_throttle.slot_store import SlotStore
from celery_throttle.store import RedisStore
from tests.helpers import QUICK, STORE_URL
from tests.slots_reference import SlotsModel

BASE_US = 1_700_000_000_000_000
LEASE_US = 30_000_000
STEPS = 60 if QUICK else 200


class Clock:
    def __init__(self) -> None:
        self.now = BASE_US

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def rig(store_client: redis.Redis) -> Iterator[tuple[SlotStore, Clock, str]]:
    prefix = f"ct-test-{uuid.uuid4().hex[:12]}"
    clock = Clock()
    store = RedisStore(STORE_URL, prefix, clock=clock)
    yield SlotStore(store), clock, state_key(prefix, "export", "acme")
    for key in store_client.scan_iter(match=f"{prefix}:*", count=1000):
        store_client.delete(key)
    store.close()


def stored(client: redis.Redis, key: str) -> tuple[dict[str, int], dict[str, int], dict[str, bytes]]:
    holders, queue, messages = slot_keys(key)
    return ({k.decode(): int(v) for k, v in client.zrange(holders, 0, -1, withscores=True)},
            {k.decode(): int(v) for k, v in client.zrange(queue, 0, -1, withscores=True)},
            {k.decode(): v for k, v in client.hgetall(messages).items()})


def walk(slots: SlotStore, clock: Clock, key: str, seed: int, limit: int) -> dict[str, int]:
    """A random walk of STEPS operations on script and model; returns what it did, by kind."""
    rng = random.Random(seed)
    model = SlotsModel()
    client = slots.store.client
    running: list[str] = []  # bodies that run (each holds its slot, and renews it)
    dead: set[str] = set()  # holders whose worker died: never renewed, never released
    woken_order: list[str] = []
    first_waits: dict[str, int] = {}
    seen: dict[str, int] = {}
    serial = 0
    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.35:
            serial += 1
            task = f"t{serial:04d}"
            kind = "take"
            if rng.random() < 0.2 and model.queue:  # a waiting (or woken) task arrives again
                task = rng.choice(sorted(model.queue))
            message = b"" if rng.random() < 0.3 else f"msg-{task}".encode()
            got = slots.take(key, task, limit, LEASE_US, message, first_waits.get(task, 0))
            want = model.take(clock.now, limit, LEASE_US, task, message, first_waits.get(task, 0))
            if got.code == SlotCode.TAKEN:
                running.append(task)
            elif got.code == SlotCode.QUEUED:
                first_waits.setdefault(task, clock.now)
        elif roll < 0.42:
            serial += 1
            task = f"t{serial:04d}"  # sent by a producer: queued there if it would wait
            kind = "enqueue"
            message = b"" if rng.random() < 0.3 else f"msg-{task}".encode()
            got = slots.enqueue(key, task, limit, LEASE_US, message)
            want = model.enqueue(clock.now, limit, LEASE_US, task, message)
        elif roll < 0.6 and running:
            task = running.pop(rng.randrange(len(running)))
            kind = "release"
            got = slots.release(key, task, limit, LEASE_US)
            want = model.release(clock.now, limit, LEASE_US, task)
        elif roll < 0.65 and running:
            task = running.pop(rng.randrange(len(running)))  # its worker is SIGKILLed
            dead.add(task)
            kind = "die"
            got = want = None
        elif roll < 0.75 and running:
            kind = "renew"
            holders = sorted(rng.sample(running, rng.randint(1, len(running))))
            lost = slots.renew({key: holders}, LEASE_US)
            want = model.renew(clock.now, LEASE_US, holders)
            assert [h for _, h in lost] == list(want.lost)
            for holder in want.lost:
                running.remove(holder)
            got = None
        elif roll < 0.8:
            kind = "sweep"
            got = slots.sweep(key, limit, LEASE_US)
            want = model.sweep(clock.now, limit, LEASE_US)
        elif roll < 0.85:
            kind = "peek"
            got = slots._run(key, "peek", 0, 0, "")
            want = model.peek(clock.now)
        elif roll < 0.88:
            kind = "evict"  # the store dropped a waiting task's message
            if model.messages:
                victim = rng.choice(sorted(model.messages))
                del model.messages[victim]
                client.hdel(slot_keys(key)[2], victim)
            got = want = None
        else:
            kind = "time"
            clock.now += rng.choice([1, 1_000, LEASE_US // 3, LEASE_US + 1])
            got = want = None
        seen[kind] = seen.get(kind, 0) + 1
        if got is not None and want is not None:
            assert (got.code, got.running, got.waiting, got.now_us, got.woken) == (
                want.code, want.running, want.waiting, want.now_us, want.woken), kind
            woken_order.extend(task for task, message in got.woken if message is not None)
        assert stored(client, key) == (model.holders, model.queue, model.messages), kind
        assert model.running(clock.now) <= limit
    seen["woken"] = len(woken_order)
    return seen


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # (each walk starts from empty keys)
@given(seed=st.integers(0, 2**32 - 1), limit=st.integers(1, 4))
def test_slots_script_matches_its_model(rig: tuple[SlotStore, Clock, str], seed: int, limit: int) -> None:
    slots, clock, key = rig
    slots.store.client.delete(*slot_keys(key))
    walk(slots, clock, key, seed, limit)


def test_walks_reach_every_operation(rig: tuple[SlotStore, Clock, str]) -> None:
    """The walks do what they say: hand-overs, reclaimed leases and lost messages happen."""
    slots, clock, key = rig
    seen: dict[str, int] = {}
    for seed in range(5):
        slots.store.client.delete(*slot_keys(key))
        for kind, count in walk(slots, clock, key, seed, 2).items():
            seen[kind] = seen.get(kind, 0) + count
    assert {"take", "enqueue", "release", "die", "renew", "sweep", "peek", "evict", "time"} <= set(seen)
    assert seen["woken"] > 10


def test_slots_go_first_come_first_served(rig: tuple[SlotStore, Clock, str]) -> None:
    """Two holders, five waiting: each release hands its slot to the one that waited longest,
    and a fresh arrival cannot take a slot that frees while others wait."""
    slots, clock, key = rig
    assert [slots.take(key, h, 2, LEASE_US).code for h in ("a", "b")] == [SlotCode.TAKEN] * 2
    for i, task in enumerate(("w1", "w2", "w3", "w4", "w5")):
        clock.now += 1
        assert slots.take(key, task, 2, LEASE_US, f"m{i}".encode()).code == SlotCode.QUEUED
    got = slots.release(key, "a", 2, LEASE_US)
    assert got.woken == (("w1", b"m0"),) and got.running == 2 and got.waiting == 4
    assert slots.take(key, "fresh", 2, LEASE_US).code == SlotCode.FULL
    assert slots.take(key, "w1", 2, LEASE_US).code == SlotCode.TAKEN  # its handed slot
    assert slots.release(key, "b", 2, LEASE_US).woken == (("w2", b"m1"),)
    # A holder whose worker died: its lease runs out, and the next call hands the slot on.
    clock.now += LEASE_US + 1
    got = slots.sweep(key, 2, LEASE_US)
    # w1's and w2's slots: w2 was handed one and never came, so it is at the head again
    assert [t for t, _ in got.woken] == ["w2", "w3"]
    assert got.waiting == 2  # w4, w5
    assert slots.release(key, "w1", 2, LEASE_US).code == SlotCode.LOST
