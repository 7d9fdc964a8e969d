"""The sharer (waits/sharer.py) on a real Redis, its passes run by hand: one worker leads a
scope at a time, another takes over when it stops, and a pass that stalled past its lease
writes nothing. The keys' slots and lines are written as window.lua keeps them (a slot
holder in the key's ``:slots``, the line's length in ``:lm``'s ``q``), so each pass reads
what a worker's would; what runs on those caps is tests/workers/test_fair_share.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis
from celery import Celery

from celery_throttle import throttle
from celery_throttle.check.limiter import Throttle
from celery_throttle.core.keys import share_key, share_lock_key, share_registry_key, state_key, window_keys
from celery_throttle.core.state import FOREVER_US
from celery_throttle.waits import sharer as sharer_module
from celery_throttle.waits.sharer import Sharer
from tests.helpers import STORE_URL

K, SCOPE = 4, "api"


@pytest.fixture
def two(prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Sharer, Sharer]]:
    """Two workers' sharers of one app whose scope's K slots are shared (not started: passes by hand)."""
    monkeypatch.setattr(sharer_module, "STANDBY_EVERY", 0.0)
    ctls = []
    for name in ("a", "b"):
        app = Celery(f"sharer-{name}", broker="memory://", set_as_current=False)

        @app.task(name="sharer.call", shared=False)
        @throttle(concurrency=K, scope=SCOPE, key="{tenant}", share=True)
        def call(tenant: str) -> None: ...

        ctls.append(Throttle(app, {"redis_url": STORE_URL, "key_prefix": prefix}))
    try:
        yield Sharer(ctls[0].setup, ctls[0].checker, ctls[0].lines), Sharer(ctls[1].setup, ctls[1].checker, ctls[1].lines)
    finally:
        for ctl in ctls:
            ctl.close()


def tenant(sharer: Sharer, name: str, *, held: int = 0, waiting: int = 0) -> str:
    """``name``'s state key, in the share, holding ``held`` slots with ``waiting`` in its line."""
    store = sharer.setup.store
    key = state_key(store.prefix, SCOPE, name)
    _, counts, _, _, _, slots, _ = window_keys(key)
    with store._redis.pipeline(transaction=False) as pipe:
        pipe.delete(slots)
        if held:
            pipe.zadd(slots, {f"holder-{i}": 1e15 for i in range(held)})
        pipe.hset(counts, "q", waiting)
        pipe.execute()
    store.share_join(SCOPE, key, 1.0, 0)
    return key


def caps(client: redis.Redis, *keys: str) -> dict[str, int]:
    return {k: int(client.get(share_key(k)) or 0) for k in keys}


def test_one_worker_leads_a_scope_and_another_takes_over_when_it_stops(two: tuple[Sharer, Sharer]) -> None:
    a, b = two
    assert a.scopes()[SCOPE] == K  # (its app's shared scopes: Celery's shared tasks of other apps too)
    assert a._lead(SCOPE) and not b._lead(SCOPE)
    x = tenant(a, "x", waiting=10)
    a.share(SCOPE, K)
    assert caps(a.setup.store._redis, x) == {x: K}  # (alone: every slot)
    a.stop()  # (gives its lock back: the other need not wait for its lease)
    assert b._lead(SCOPE)
    y = tenant(b, "y", waiting=10)
    b.share(SCOPE, K)  # (x holds none yet: its cap lowered to its share, y raised within what is left)
    assert caps(b.setup.store._redis, x, y) == {x: 2, y: 2}


@pytest.mark.parametrize("renew", ["as built", "mutation: trusts its lease"])
def test_a_pass_that_stalled_past_its_lease_writes_nothing(two: tuple[Sharer, Sharer], renew: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """a reads (x has work, y none), then stalls; its lease runs out, b takes the scope, y
    gets work, and b gives x and y 2 each. a, going on from its read, would give x all 4:
    6 slots of a scope of 4."""
    a, b = two
    client = a.setup.store._redis
    assert a._lead(SCOPE)
    x, y = tenant(a, "x", waiting=10), tenant(a, "y")
    read = a.setup.store.share_read

    def stalled(keys: Any) -> Any:
        got = read(keys)
        client.delete(share_lock_key(a.setup.store.prefix, SCOPE))  # (its lease ran out meanwhile)
        assert b._lead(SCOPE)
        tenant(b, "y", waiting=10)
        b.share(SCOPE, K)
        return got

    monkeypatch.setattr(a.setup.store, "share_read", stalled)
    if renew != "as built":
        monkeypatch.setattr(Sharer, "_renew", lambda self, scope: True)
    a.share(SCOPE, K)
    got = caps(client, x, y)
    if renew == "as built":
        assert got == {x: 2, y: 2} and SCOPE not in a._locks
    else:
        assert sum(got.values()) > K, got  # (the check bites: a's stale raise lands)


@pytest.mark.parametrize("keep", ["as built", "mutation: forgets what it saw"])
def test_a_registry_evicted_is_written_back(two: tuple[Sharer, Sharer], keep: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """x holds all 4 slots; the scope's registry is evicted; y comes. A pass that did not
    count x would give y 4 more: 8 running of a scope of 4."""
    a, _ = two
    client = a.setup.store._redis
    assert a._lead(SCOPE)
    x = tenant(a, "x", waiting=10)
    a.share(SCOPE, K)
    assert caps(client, x) == {x: K}
    tenant(a, "x", held=K, waiting=10)  # (its 4 start)
    client.delete(share_registry_key(a.setup.store.prefix, SCOPE))
    if keep != "as built":
        monkeypatch.setattr(a, "_known", {})
    y = tenant(a, "y", waiting=10)
    a.share(SCOPE, K)
    got = caps(client, x, y)
    if keep == "as built":
        # (x's cap lowered to its share; y's raise waits for x's bodies to end: none is stopped)
        assert got == {x: 2, y: 0} and set(a.setup.store.share_members(SCOPE)) == {x, y}
        slots = window_keys(x)[5]
        client.zpopmin(slots, 2)  # (two of x's bodies end)
        a.share(SCOPE, K)
        assert caps(client, x, y) == {x: 2, y: 2}
    else:
        assert got[x] + got[y] > K or got == {x: 0, y: K}, got  # (x's 4 bodies run on beside y's cap)


def test_a_slow_pass_spaces_the_next(two: tuple[Sharer, Sharer], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of 60 ms of the sharer's CPU (a share of thousands of keys) is followed by 540 ms
    without one (PASS_DUTY), woken or not: some 2 passes a second, where a pass every
    SHARE_EVERY after each would make 6. A pass that waits on the store as long costs the
    worker nothing, and is not spaced so."""
    a, b = two
    passes: list[float] = []
    busy = [True]

    def slow(scope: str, total: int) -> tuple[dict[str, int], list[str]]:
        passes.append(time.monotonic())
        a.setup.store.share_poke(scope)  # (a wake-up waits for every pass)
        if busy[0]:
            spent = time.thread_time()
            while time.thread_time() - spent < 0.06:
                pass
        else:
            time.sleep(0.06)
        return {}, []

    monkeypatch.setattr(a, "share", slow)
    monkeypatch.setattr(a, "scopes", lambda: {SCOPE: K})  # (one scope: a pass each round)
    a.start()
    try:
        time.sleep(1.5)
    finally:
        a.stop()
        a.join(5)
    gaps = [later - sooner for sooner, later in pairwise(passes)]
    assert sharer_module.PASS_DUTY == 0.1
    assert gaps and min(gaps) >= 0.55, gaps
    # And a pass that only waits on the store (a slow link) is followed by the next when woken
    # (another scope: a's lock of SCOPE runs out by itself, stopped from another thread)
    busy[0], passes[:] = False, []
    monkeypatch.setattr(b, "share", slow)
    monkeypatch.setattr(b, "scopes", lambda: {f"{SCOPE}-slow-link": K})
    b.start()
    try:
        # (2 s: its first round pays its connection's set-up in CPU, and is spaced by it:
        # 0.71 s of a 1 s window once in make test, leaving 5 passes)
        time.sleep(2.0)
    finally:
        b.stop()
        b.join(5)
    gaps = [later - sooner for sooner, later in pairwise(passes)]
    assert len(gaps) >= 8 and sorted(gaps)[len(gaps) // 2] < 0.2, gaps


def test_a_key_raised_before_its_line_is_noted_is_looked_at(two: tuple[Sharer, Sharer]) -> None:
    """A task put in its key's line at publish: the call's note to the index (its look:
    never, while the key has no cap) can land after the pass its share join woke has raised
    the key's cap. The pass notes the key due now, and the late note changes nothing: a
    one-off tenant's task no longer waits for good (1 run in 10 under load did)."""
    a, _ = two
    assert a._lead(SCOPE)
    x = tenant(a, "x", waiting=1)
    store = a.setup.store
    part = store.index_part(x)
    computed = store.now_us() - 1_000  # (the call's script ran before the pass)
    a.share(SCOPE, K)
    assert caps(store._redis, x) == {x: K}
    store.index_note(x, FOREVER_US, computed)  # (the late note: no cap when it was computed)
    due = store._redis.zscore(store.index_keys(part)[0], x)
    assert due is not None and due <= store.now_us(), due
