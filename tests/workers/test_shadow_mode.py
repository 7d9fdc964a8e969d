"""Shadow mode on real workers: a throttle that counts and reports what it would hold back,
and holds nothing; switched to enforcing (and back) live, for every worker.

2 × 2 prefork workers on each broker; tasks sent by a producer process that imports the
tasks module, as users send them.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

import celery_throttle
from celery_throttle.check.controls import CONTROL_REFRESH
from tests.helpers import (
    STORE_URL,
    WorkerGroup,
    assert_each_ran_once,
    max_in_window,
    new_label,
    run_cli,
    wait_for,
)

#: As test_operate's: the switch's refresh, then a broker round trip and a pool dispatch
#: on a loaded 2-core machine.
SWITCHED_WITHIN = 1.0 + 0.5


@pytest.fixture
def ctl(workers: WorkerGroup) -> Iterator[celery_throttle.Throttle]:
    app = Celery(f"operator-{uuid.uuid4().hex[:6]}", broker=workers.broker, set_as_current=False)
    throttle = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=workers.prefix)
    yield throttle
    for scope in ("shadow-api", "shadow-slots"):
        throttle.clear_mode(scope)
    time.sleep(CONTROL_REFRESH + 0.1)


def shadow_notes(workers: WorkerGroup, ids: list[str]) -> list[dict]:
    return [n for n in workers.notes("shadowed") if n["id"] in ids]


def test_a_throttle_in_shadow_mode_holds_nothing_and_reports_what_it_would_have_held(
        workers: WorkerGroup, ctl: celery_throttle.Throttle) -> None:
    # Given a throttle of 2/s per tenant in shadow mode, and 10 of its tasks sent at once
    # by a producer
    label, tenant = new_label(), f"t-{new_label()}"
    produced = workers.produce({"how": "delay", "task": "shadowed", "args": [label, tenant], "count": 10})
    ids = produced["sent"][0]
    # When the workers run them
    starts = workers.wait_starts(label, 10, timeout=30)
    # Then each ran once, none was held (no denial, at publish or in a worker), and more
    # than 2 started within a second, as enforcing would never have let them
    assert_each_ran_once(starts, ids)
    assert produced["denials"] == []
    assert not [d for d in workers.denials() if d["id"] in ids]
    # And what enforcing would have held back was reported: a signal for each, with the
    # wait it would have had (up to the 4 s that 10 at 2/s take), said by the rate
    wait_for(lambda: shadow_notes(workers, ids), 5, what="a shadow report")
    notes = shadow_notes(workers, ids)
    assert 1 <= len(notes) <= 8, notes
    assert {n["reason"] for n in notes} == {"rate"} and {n["key"] for n in notes} == {tenant}
    assert all(0 < n["delay"] <= 4.5 for n in notes), notes
    longest = max(notes, key=lambda n: n["delay"])
    started = next(e["t"] for e in starts if e["id"] == longest["id"])
    assert started < longest["t"] + longest["delay"], "it waited as if enforced"
    assert max_in_window([e["t"] for e in starts], 1.0) > 2
    # And throttle status says so, counted in the store for every worker
    status = ctl.status("shadow-api", key=tenant)
    assert status.mode != "enforce"  # (the operator's app has none of the tasks: None, unless set live)
    assert status.shadow is not None and (status.shadow.checked, status.shadow.held) == (10, len(notes))
    assert status.shadow.longest == pytest.approx(longest["delay"], abs=1e-3)
    shown = run_cli(workers, "status", "shadow-api", "--key", tenant)
    assert shown.returncode == 0, shown.stderr
    assert f"is in shadow mode: {len(notes)} of the 10 starts checked in shadow mode would have been held back" \
        in shown.stdout, shown.stdout
    listed = json.loads(run_cli(workers, "status", "--match", "shadow-api", "--json").stdout)
    assert any(k["key"] == tenant and k["mode"] == "shadow" and k["shadow"]["held"] == len(notes)
               for k in listed["keys"])


def test_a_shadow_concurrency_limit_runs_every_body_and_reports_those_it_would_have_held(
        workers: WorkerGroup, ctl: celery_throttle.Throttle) -> None:
    # Given a throttle of 1 body at a time in shadow mode, and 3 bodies of 3 s sent at once
    label = new_label()
    ids = [workers.send("shadowed_slot", label, 3.0) for _ in range(3)]
    # When they run
    starts = sorted(e["t"] for e in workers.wait_starts(label, 3, timeout=30))
    # Then at least two ran at once (enforcing would have run one at a time), and each body
    # that started beside a running one was reported for its slot
    assert min(b - a for a, b in itertools.pairwise(starts)) < 3.0
    wait_for(lambda: shadow_notes(workers, ids), 5, what="a shadow report")
    notes = shadow_notes(workers, ids)
    assert notes and {n["reason"] for n in notes} == {"concurrency"}, notes
    # and the shadow slots were given back as the bodies ended
    wait_for(lambda: len(workers.starts(label)) == 3 and not ctl.status("shadow-slots").running, 10,
             what="the shadow slots given back")


def test_switched_to_enforce_every_worker_holds_within_a_second_and_back_in_shadow_the_line_goes(
        workers: WorkerGroup, ctl: celery_throttle.Throttle) -> None:
    label, tenant = new_label(), f"t-{new_label()}"
    # Given the shadow throttle switched to enforcing, live (through the command line)
    switched = run_cli(workers, "mode", "enforce", "shadow-api")
    assert switched.returncode == 0 and "enforce mode" in switched.stdout, switched.stderr
    time.sleep(CONTROL_REFRESH + 0.1)
    # When 10 of its tasks are sent
    ids = [workers.send("shadowed", label, tenant) for _ in range(10)]
    wait_for(lambda: len(workers.starts(label)) >= 2, 15, what="the first starts")
    # Then it holds them to 2/s on every worker
    wait_for(lambda: {d["id"] for d in workers.denials()} & set(ids), 10, what="a task held back")
    early = workers.starts(label)
    assert max_in_window([e["t"] for e in early], 0.95) <= 2
    # And switched back to shadow mode, the tasks waiting in its line go at once
    ctl.set_mode("shadow", "shadow-api")
    switched_at = time.time()
    starts = workers.wait_starts(label, 10, timeout=30)
    assert_each_ran_once(starts, ids)
    assert max(e["t"] for e in starts) - switched_at < SWITCHED_WITHIN + CONTROL_REFRESH, \
        "the line was not let go at once"
    assert ctl.status("shadow-api", key=tenant).waiting == 0
