"""A producer is also an attacker (docs/security.md): what a message carries, fed to the
line at random and at the extremes, and copied from a real task by a plain producer.

What a message can put in front of the line's script is its ``celery_throttle`` header's
ticket (``t``) and entry (``i``), Celery's ``expires`` and its own body (stored as the
entry's message). Nothing of it may start a task the key has no room for, change a window,
move a waiting task, or make a script run longer: the work is counted in Redis commands
(commandstats on a redis-server of the test's own), never timed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_throttle.core.header import HEADER, Header
from celery_throttle.core.keys import state_key, window_keys
from celery_throttle.core.protocol import Code, Entry, WindowCall
from celery_throttle.core.rates import parse_rate
from celery_throttle.store.client import RedisStore
from tests.helpers import (
    RedisServer,
    WorkerGroup,
    assert_each_ran_once,
    max_started_in,
    new_label,
    run_cli,
    wait_for,
)

QUICK = os.environ.get("CT_QUICK") == "1"
NOW_US = 1_700_000_000_000_000
#: Tasks waiting in the key's line while the attacker's claims come.
WAITING = 5
#: Redis commands a forged claim may run beyond the most a task's own denial runs: the
#: claim looks its ticket up (ZSCORE, HEXISTS, ZSCORE of the used entries) before it is
#: taken for a fresh call.
LOOKUP_COMMANDS = 4


class Clock:
    def __init__(self) -> None:
        self.now = NOW_US

    def __call__(self) -> int:
        return self.now


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _commands(client: redis.Redis) -> int:
    """Commands the server ran so far, scripts' own calls included, but not this INFO."""
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


class FullKey:
    """A key of ``2/s`` whose window is full, with WAITING tasks in its line."""

    def __init__(self, url: str, n: int) -> None:
        self.clock = Clock()
        self.store = RedisStore(url, f"adv{n}", clock=self.clock)
        self.client = redis.Redis.from_url(url)
        self.call = WindowCall("sliding", (parse_rate("2/s"),), 1, slack_us=10_000)
        self.key = state_key(f"adv{n}", "api", "acme")
        self.ids: list[str] = []
        for i in range(2 + WAITING):
            got = self.store.acquire(self.key, self.call, entry=Entry(f"e{i}:own", b"m%d" % i, f"task{i}", 0, 0, 8))
            assert got.code == (Code.RUN if i < 2 else Code.QUEUED)
            if i >= 2:
                self.ids.append(f"e{i}:own")

    def snapshot(self) -> tuple[dict[bytes, bytes], list[bytes]]:
        keys = window_keys(self.key)
        return self.client.hgetall(keys[0]), self.client.zrange(keys[2], 0, -1)

    def denial_commands(self) -> int:
        """The commands a task's own denial runs here (a fresh call that joins the line)."""
        before = _commands(self.client)
        got = self.store.acquire(self.key, self.call, entry=Entry("probe:x", b"probe", "probe", 0, 0, 8))
        ran = _commands(self.client) - before - 1  # (the EVALSHA itself)
        assert got.code == Code.QUEUED
        self.store.window(self.key, "drop", self.call, "probe:x")
        return ran

    def close(self) -> None:
        for name in self.client.scan_iter(match=f"{self.key.split(':')[0]}:*"):
            self.client.delete(name)
        self.client.close()
        self.store.close()


#: What an attacker may write in a ticket or an entry id: anything, a waiting task's own
#: entry id, nothing, or a very long string.
_ids = st.one_of(st.text(max_size=40), st.sampled_from(["e2:own", "e6:own", "", "x" * 100_000]),
                 st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
_expires = st.sampled_from([0, -1, 1, NOW_US - 1, NOW_US + 1, 2**53 - 1, 2**63 - 1])


@pytest.mark.script
@settings(max_examples=20 if QUICK else 150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ticket=_ids, entry=_ids, expires=_expires, message=st.sampled_from([b"", b"forged", b"\x00" * 1000]),
       stale_ok=st.booleans())
def test_nothing_a_message_carries_starts_a_task_moves_the_line_or_costs_more_than_a_denial(
        own_redis: RedisServer, ticket: str, entry: str, expires: int, message: bytes, stale_ok: bool) -> None:
    # Given a key whose window is full and whose line holds WAITING tasks
    key = FullKey(own_redis.url, abs(hash((ticket, entry, expires))) % 10**9)
    try:
        bound = key.denial_commands() + LOOKUP_COMMANDS
        windows, line = key.snapshot()
        # When a message with a forged ticket, entry id, expiry and body is claimed
        before = _commands(key.client)
        got = key.store.claim(key.key, key.call, ticket, early_us=1_000_000, holder="h:attacker",
                              entry=Entry(entry, message, "attack", expires, 0, 8), stale_ok=stale_ok)
        ran = _commands(key.client) - before - 1
        # Then it does not start, the windows are as they were, the tasks waiting keep
        # their places (the message may only join the back of the line), and the script
        # ran no more commands than a task's own denial and the ticket's lookup
        assert got.code in (Code.QUEUED, Code.DENIED, Code.DUPLICATE), Code(got.code).name
        after_windows, after_line = key.snapshot()
        assert after_windows == windows
        assert after_line[:len(line)] == line and len(after_line) <= len(line) + 1
        assert ran <= bound, f"a forged claim ran {ran} commands, a denial {bound - LOOKUP_COMMANDS}"
    finally:
        key.close()


@pytest.mark.script
def test_the_bound_bites_a_claim_that_looks_at_the_whole_line_is_over_it(own_redis: RedisServer) -> None:
    # (the measure the property above uses sees a script that does more: a release that
    # looks at every waiting task runs more commands than a denial and a lookup)
    key = FullKey(own_redis.url, 1)
    try:
        bound = key.denial_commands() + LOOKUP_COMMANDS
        before = _commands(key.client)
        key.store.window(key.key, "drain", key.call, 64)
        assert _commands(key.client) - before - 1 > bound
    finally:
        key.close()


def test_a_real_ticket_copied_onto_new_tasks_by_a_plain_producer_starts_nothing_early(
        workers: WorkerGroup) -> None:
    # Given a keyed 3/4s quota, and one of its tasks that waited in the line, was released
    # and started with its ticket (which any broker client may read off its message)
    label, tenant = new_label(), f"victim-{new_label()}"
    ids = [workers.send("slow_quota", label, tenant) for _ in range(4)]
    workers.wait_starts(label, 4, timeout=20, settle=0)
    used = window_keys(state_key(workers.prefix, "tests.taskapp.slow_quota", tenant))[6]
    tickets = [t.decode() for t in workers.store_client.zrange(used, 0, -1)]
    assert tickets, "no task of the key started on a ticket"
    copied = Header(state_key(workers.prefix, "tests.taskapp.slow_quota", tenant), tickets[0], 0, 0,
                    tickets[0]).value()
    # When a producer with broker access only (no install) sends 9 new tasks carrying that
    # header, copied as it is, and with a deferral count and an error count at their ends
    forged = [workers.send("slow_quota", label, tenant, headers={HEADER: copied}) for _ in range(6)]
    for extreme in (json.dumps({"v": 3, "k": "x", "t": tickets[0], "n": 2**63 - 1, "e": 2**63 - 1}),
                    {"v": 3, "t": tickets[0], "n": -1, "e": -(2**63) + 1}, "not json"):
        forged.append(workers.send("slow_quota", label, tenant, headers={HEADER: extreme}))
    # Then each ran once, as a new task behind the line: never more than 3 in any 4 s
    starts = workers.wait_starts(label, 4 + len(forged), timeout=60)
    assert_each_ran_once(starts, ids + forged)
    assert max_started_in([e["t"] for e in starts], 4.0) <= 3


def test_a_tenant_id_of_control_characters_and_a_lone_surrogate_waits_runs_and_shows_escaped(
        workers: WorkerGroup) -> None:
    # Given a producer with broker access only, sending 10 tasks of a 3/4s keyed quota
    # for a tenant id that holds a lone surrogate, a newline and a terminal escape
    label, tenant = new_label(), f"a\ud800b\n\x1b[31m{new_label()}"
    ids = [workers.send("slow_quota", label, tenant) for _ in range(10)]
    # When its tasks wait in their line, an operator runs status and parked --tasks
    wait_for(lambda: workers.starts(label), 15, what="the first start")
    # (parked first: the last of them waits 12 s, however slowly the commands start)
    parked = run_cli(workers, "parked", "--tasks")
    status = run_cli(workers, "status", "--match", "tests.taskapp.slow_quota")
    # Then both answer, with the id escaped (no raw escape, newline or surrogate reaches
    # the terminal), and every task runs once, at most 3 in any 4 s
    shown = "a\\ud800b\\n\\x1b[31m"
    assert status.returncode == 0 and shown in status.stdout, status.stdout + status.stderr[-2000:]
    assert parked.returncode == 0 and shown in parked.stdout, parked.stdout + parked.stderr[-2000:]
    for done in (status, parked):
        assert "\x1b" not in done.stdout and "\ud800" not in done.stdout
    starts = workers.wait_starts(label, 10, timeout=60)
    assert_each_ran_once(starts, ids)
    assert max_started_in([e["t"] for e in starts], 4.0) <= 3


def test_a_task_that_expires_while_it_waits_in_its_line_never_runs_and_holds_nothing(
        workers: WorkerGroup) -> None:
    # Given a keyed 3/4s quota spent by 3 tasks
    label, tenant = new_label(), f"expiring-{new_label()}"
    first = [workers.send("slow_quota", label, tenant) for _ in range(3)]
    workers.wait_starts(label, 3, timeout=20, settle=0)
    # When a task that expires in 2 s joins its line, and one that does not after it
    expiring = workers.send("slow_quota", label, tenant, expires=2)
    after = workers.send("slow_quota", label, tenant)
    # Then the one that expired while it waited never runs (its expiry is a moment, not
    # counted again from its release), and the one behind it starts in the next window
    starts = workers.wait_starts(label, 4, timeout=20)
    assert_each_ran_once(starts, [*first, after])
    assert expiring not in {e["id"] for e in starts}
