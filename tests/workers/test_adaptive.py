"""Limits that learn the downstream, on real workers: a throttle declared at ``20/s`` with
``adapt=True`` in front of a downstream that takes 5 calls a second (tests.taskapp's
``adaptive_call``: a refusal is a 429, and the task raises Backoff), sent by a producer
that only imports the task module and sends.

The refusals come while the limit falls from its ceiling to the downstream's (a few
windows); after that they are rare, every call runs once, and status, the CLI and
``throttle why`` show the limit in force and why it moved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

import celery_throttle
from tests.helpers import ROOT, STORE_URL, WorkerGroup, assert_each_ran_once, max_started_in, new_label
from tests.taskapp import app as tasks_app

#: The downstream's limit (calls per second) and the calls sent.
DOWNSTREAM, CALLS = 5, 60


@pytest.fixture
def operator(workers: WorkerGroup) -> Iterator[celery_throttle.Throttle]:
    ctl = celery_throttle.Throttle(tasks_app, {"redis_url": STORE_URL, "key_prefix": workers.prefix})
    yield ctl
    ctl.close()


@pytest.mark.parametrize("retry_after", [1, None], ids=["retry-after", "no-retry-after"])
def test_an_adaptive_limit_learns_a_downstream_below_its_declared_rate_and_says_so(
        workers: WorkerGroup, operator: celery_throttle.Throttle, retry_after: int | None) -> None:
    # Given a downstream that takes 5 calls a second behind a throttle declared at 20/s,
    # whose refusals say Retry-After: 1, or nothing (most 503s, many 429s: the lowered
    # limit is the answer, and no refusal pauses the scope; it paused 30 s each time)
    label = new_label()
    workers.records.set(f"{workers.prefix}:downstream-limit", DOWNSTREAM)
    # When a producer sends 60 calls at once
    out = workers.produce({"how": "delay", "task": "adaptive_call", "args": [label, 0, retry_after], "count": CALLS})
    starts = workers.wait_starts(label, CALLS, timeout=90)
    # Then every call ran once (a refused one ran again, its retries untouched)
    assert_each_ran_once(starts, out["sent"][0])
    assert all(s["retries"] == 0 for s in starts)
    refused = [json.loads(r) for r in workers.records.lrange(f"{workers.prefix}:refused", 0, -1)]
    refused = sorted(r["t"] for r in refused if r["label"] == label)
    times = sorted(s["t"] for s in starts)
    # And the refusals came while the limit fell to the downstream's: once it has (the
    # law takes a few windows from 20 to 5), they are rare, and the calls run at about
    # the downstream's pace (60 at 5/s: 12 s at best)

    settled = times[0] + 8.0
    late = [t for t in refused if t > settled]
    assert len(late) <= 5, (refused, times)
    assert max_started_in(times, 1.0) <= 2 * DOWNSTREAM + 5
    assert times[-1] - times[0] < 4 * CALLS / DOWNSTREAM, times
    # And the key shows why its limit moved, and the limit in force as it is at each read
    # (the level climbs back while no refusal comes: each read is checked on its own, and
    # two reads only in the order the level moves, never for the same answer)
    status = operator.status("adaptive-api")
    assert status.adaptive is not None and status.adaptive.pushback is not None, status
    assert status.adaptive.pushback.reason == "backoff", status
    assert status.rates[0].rate.limit <= 20 and status.adaptive.share <= 1.0, status
    table = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", "status",
                            "adaptive-api"], cwd=ROOT, env=workers._environ(), capture_output=True, text=True,
                           timeout=60, check=True).stdout
    cli = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", "status", "adaptive-api",
                          "--json"], cwd=ROOT, env=workers._environ(), capture_output=True, text=True, timeout=60,
                         check=True)
    shown = json.loads(cli.stdout)
    # (read seconds after the last call, beside a busy machine, the key may be back at its
    # ceiling and its state expired: then it shows no pushback, at the ceiling, or no
    # adaptive state at all)
    adaptive = shown["keys"][0]["adaptive"] or {"last_pushback": None, "share": 1.0}
    pushback = adaptive["last_pushback"]
    assert (pushback is not None and pushback["reason"] == "backoff") or adaptive["share"] >= 1.0, shown
    # (the table, read first, marks a level below the ceiling; a level at the ceiling then
    # is at the ceiling in the JSON read after it: it only climbs, no refusal coming)
    assert "(adapt " in table or adaptive["share"] >= 1.0, (table, shown)
    workers.records.delete(f"{workers.prefix}:downstream-limit", f"{workers.prefix}:downstream")
