"""The line, checked against its pure-Python twin and against plain truth.

Every operation of window.lua with line.lua runs on a real Redis (through ``RedisStore``,
with an injected clock) and on ``tests.line_reference.KeyModel``: the replies must agree
field for field, and everything stored (the windows, the line's counts, the line, the
messages and what each entry is, the tasks out, the slots, and the key's place in the index
of lines, which on a single Redis each call writes itself) must be what the model holds.
The walks (``tests.line_walk``) mix every operation: fresh calls that run or join the
line, publish, Backoff's front, releases, claims on time, early, late and copied, acks, give-backs, settles of
random size, slots taken, renewed and given back, pauses, live limits, resets and time; and
between calls, a releaser's settle and an operator's wake-up of the key in the index, with
calls made under controls read before and after that wake-up.

Beside the twin, properties that know nothing of its state:
- no window over its limit: at each start, the units known then of every start in its
  window (a refund lowers them, an overrun raises them: the only excess is the overrun
  of calls already started) fit the limit; with refunds alone, no window ever holds more
  than the limit of reported units;
- first come, first served: what leaves the line (released, or reported) is its head;
- nothing lost or doubled: every task that joined a line ends started once, reported, or
  still waiting or out; a ticket starts one body;
- work conservation: after any call that may release, a head that fits within the lead
  is released (unless the call's batch ran out), and the key's next look is no later than
  its head fits.
"""

from __future__ import annotations

import uuid
import zlib
from collections import Counter

import pytest
import redis

from celery_throttle.core.keys import state_key, window_keys
from celery_throttle.core.protocol import Code, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.core.state import StateLayout
from celery_throttle.core.timing import ScriptPolicy
from celery_throttle.store.client import RedisStore
from tests.helpers import QUICK, STORE_URL
from tests.line_walk import FakeClock, run_walk
from tests.reference import max_units_in_any_interval, max_units_per_aligned_window

ALGORITHMS = ("sliding", "fixed")
BASE_US = 1_700_000_000_000_000
RATE_SETS: dict[str, tuple[str, ...]] = {
    "one": ("5/s",),
    "two": ("5/s", "12/3s"),
    "three": ("3/s", "10/10s", "40/m"),
    "same-period": ("3/s", "5/s"),
    "wide": ("50/s", "200/10s"),
    "day": ("100/d",),
    "tiny": ("2/10ms",),
    # Rates of different units (requests and tokens of one API): a call counts a cost of
    # each unit, each rate its own unit's.
    "requests-tokens": ("5/s", "40 tokens/s"),
    "rpm-tpm": ("3/s", "25 tokens/s", "60 tokens/10s"),
    "two-named": ("4 requests/s", "9 calls/2s", "30 tokens/s"),
    "none": (),  # a concurrency limit alone
}
WALKS = 3 if QUICK else 8
#: Another policy: small batches and short leases, so that their edges are walked too.
ODD_POLICY = ScriptPolicy(line_batch=2, send_lease_ms=300, out_lease_ms=900, grant_keep_ms=50, index_stale_ms=200,
                          grant_slacks=3, lead_jitters=1, settle_rounds=2, learnt_cap_parts=4, delay_gain_parts=2,
                          jitter_gain_parts=3, priority_step=3)
#: A state layout unlike the default in every field: few buckets per window and few kept,
#: so that a sliding state folds, and a fixed one keeps few windows ahead.
ODD_LAYOUT = StateLayout(buckets=7, max_buckets=10, max_ahead=3, keep_ahead=1)


@pytest.mark.parametrize("rate_set", sorted(RATE_SETS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_line_matches_its_model_and_keeps_every_promise(
    redis_client: redis.Redis, key_prefix: str, algorithm: str, rate_set: str
) -> None:
    # Given a key of these rates (with slots too, and slots alone), walked at random
    clock = FakeClock(BASE_US)
    store = RedisStore(STORE_URL, key_prefix, clock=clock)
    seen: Counter[str] = Counter()
    try:
        for n in range(WALKS):
            concurrency = 0 if RATE_SETS[rate_set] and n % 2 == 0 else 1 + n % 3
            # When every operation runs on the script and on its model (a key's slots its
            # own, or its cap in a scope's share, moved by the walk as the sharer would)
            walk = run_walk(store, clock, algorithm, RATE_SETS[rate_set],
                         seed=zlib.crc32(f"{algorithm}/{rate_set}/{n}".encode()), concurrency=concurrency,
                         shared=concurrency > 0 and n % 4 == 1)
            seen.update(walk.seen)
    finally:
        store.close()
    # Then they agreed at every step and every property held (asserted as they walked),
    # and the walks went where the promises are tested
    wanted = {"queued", "released", "start", "copied", "slot given back", "duplicate", "pending copy",
              "share cap moved", "handed back", "taken back", "index settled", "index woken", "releaser woken"}
    if RATE_SETS[rate_set]:
        wanted |= {"settled", "back in line", "stale", "K lifted"}
    if rate_set in ("one", "two", "tiny", "requests-tokens"):  # (where room comes unit by unit)
        wanted |= {"granted"}
    if seen["granted"] >= 30:  # (a process woken past its grant's keep: a sixth of the grants looked at again)
        wanted |= {"late grant"}
    # (the quick passes walk too little to reach them all: they check only agreement and
    # the properties)
    assert QUICK or wanted <= set(seen), f"the walks never saw {wanted - set(seen)}: {seen}"


@pytest.mark.parametrize("loaded_with", ["policy", "layout"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_line_matches_its_model_under_another_policy_or_layout(
    redis_client: redis.Redis, key_prefix: str, algorithm: str, loaded_with: str
) -> None:
    # Given the script and the model both loaded with small batches and short leases, or
    # with a layout of few buckets (a sliding state folds)
    clock = FakeClock(BASE_US)
    odd = {"policy": ODD_POLICY} if loaded_with == "policy" else {"layout": ODD_LAYOUT}
    store = RedisStore(STORE_URL, key_prefix, clock=clock, **odd)
    try:
        for n, names in enumerate((("5/s",), ("5/s", "40 tokens/s"), ())):
            # When walks run on both (their edges reached: batches run out, leases end)
            walk = run_walk(store, clock, algorithm, names,
                         seed=zlib.crc32(f"odd/{loaded_with}/{algorithm}/{n}".encode()),
                         concurrency=0 if names and n == 0 else 2)
            # Then they agreed all along
            assert walk.seen["released"], walk.explain("nothing was released")
    finally:
        store.close()


#: Tasks in the deep line below (the suite's; the bench measures the cost to 100 000).
DEEP = 500 if QUICK else 2_000


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_deep_line_is_released_in_order_and_the_window_stays_small(
    redis_client: redis.Redis, key_prefix: str, algorithm: str
) -> None:
    from celery_throttle.core.protocol import Entry

    # Given DEEP tasks waiting in the line of one key of 20/s
    clock = FakeClock(BASE_US)
    store = RedisStore(STORE_URL, key_prefix, clock=clock)
    rates = (parse_rate("20/s"),)
    call = WindowCall(algorithm, rates, 1, slack_us=10_000)
    key = state_key(key_prefix, "deep", algorithm)
    sent = [f"t{n:05d}:{uuid.uuid4().hex[:8]}" for n in range(DEEP)]
    try:
        codes = Counter(store.acquire(key, call, entry=Entry(e, b"m-" + e.encode(), e, 0, 0, 8)).code for e in sent)
        assert codes == {Code.RUN: 20, Code.QUEUED: DEEP - 20}
        # When time passes and the line is released as its key has room, each task
        # arriving as soon as it is released
        released: list[str] = []
        starts: list[int] = []
        largest = 0
        while len(released) < DEEP - 20:
            reply = store.release(key, call, 64)
            for r in reply.reported:
                assert r.kind == "r", r
                released.append(r.id)
                got = store.claim(key, call, r.id, early_us=1_000_000, holder=f"h-{r.id}")
                assert got.code in (Code.RUN, Code.RUN_AT), (r.id, got)
                starts.append(got.start_us if got.code == Code.RUN_AT else clock.now)
            largest = max(largest, redis_client.memory_usage(key) or 0)
            for name in window_keys(key):  # (TTLs run in real time: never mid-walk on a slow machine)
                if 0 <= redis_client.pttl(name) < 600_000:
                    redis_client.pexpire(name, 600_000)
            clock.now = max(reply.due_us, clock.now + 1_000) if reply.due_us else clock.now + 50_000
        # Then they were released first come first served, each once, never more than the
        # limit in any window, and the window's state stayed small however deep the line
        assert released == sent[20:]
        assert (max_units_in_any_interval(((t, 1) for t in starts), 1_000_000) if algorithm == "sliding"
                else max_units_per_aligned_window(((t, 1) for t in starts), 1_000_000)) <= 20
        assert largest < 4096
        assert not redis_client.exists(window_keys(key)[2])
    finally:
        store.close()
