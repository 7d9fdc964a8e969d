"""Costs settled after the call, with real workers: a refund lets later starts in sooner, an
overrun pushes them out, ``charge()`` and ``cost_after=`` alike; charge() outside a throttled
body and a bad unit count fail clearly."""

from __future__ import annotations

import json
import time
import uuid

import pytest

import celery_throttle
from celery_throttle import ThrottleError
from tests.helpers import STORE_URL, WorkerGroup, new_label, run_cli
from tests.taskapp import app as tasks_app

#: How long after its admission the first body may note its start (a busy machine): the
#: window is kept on admissions, the test reads the bodies' own start times.
BODY_DELAY_S = 0.2


def test_a_refund_lets_later_starts_in_sooner(workers: WorkerGroup) -> None:
    """6/2s, estimated at 3 a call: two a window as estimated. Calls sent one after another
    (0.2 s apart) each report 1: the window counts what was used, and those checked after
    the reports start in the first window too. (Starts already reserved keep their place:
    a burst sent at once is reserved on its estimates.)"""
    refunded, kept = new_label(), new_label()
    for label, used in ((refunded, 1), (kept, 3)):
        tenant = f"t-{uuid.uuid4().hex[:6]}"
        for _ in range(6):
            workers.send("estimated_high", label, tenant, used)
            time.sleep(0.2)
    got = {label: sorted(e["t"] for e in workers.wait_starts(label, 6, timeout=30)) for label in (refunded, kept)}
    first = {label: sum(1 for t in got[label] if t - got[label][0] < 1.9) for label in got}
    assert first[kept] == 2  # the estimate: 6 units a window
    assert first[refunded] >= 3, f"with refunds {first[refunded]} started in the first window"


@pytest.mark.parametrize(("task", "overrun", "window"), [("estimated_low", 4, 2.0), ("tokens_after", 8, 10.0)],
                         ids=["one unit", "tokens, by unit"])
def test_an_overrun_pushes_later_starts_out(workers: WorkerGroup, task: str, overrun: int, window: float) -> None:
    """Estimated at 1 unit (4/2s; or 8 tokens per 10 s, beside 20 requests): the first call
    reports its window's whole limit through cost_after (a count, or a dict by unit); the
    next one, sent after that report, waits for the window to clear instead of starting at
    once."""
    label, tenant = new_label(), f"o-{uuid.uuid4().hex[:6]}"
    workers.send(task, label, tenant, overrun)
    first = workers.wait_starts(label, 1, timeout=15, settle=0.5)[0]
    workers.send(task, label, tenant, 1)
    second = next(e for e in workers.wait_starts(label, 2, timeout=window + 15) if e["id"] != first["id"])
    # Without the overrun it would start about 0.5 s after the first (the settle above).
    assert second["t"] - first["t"] >= window - BODY_DELAY_S


def test_tokens_settled_by_unit_let_later_calls_in_and_requests_keep_their_count(workers: WorkerGroup) -> None:
    """20 requests and 8 tokens per 10 s, each call estimated at 4 tokens: two a window as
    estimated. Calls sent 0.3 s apart that each report 1 token all start in the first
    window; the requests rate counts one per call, the tokens rate what was reported."""
    refunded, kept = new_label(), new_label()
    tenants = {label: f"u-{uuid.uuid4().hex[:6]}" for label in (refunded, kept)}
    for _ in range(5):
        for label, used in ((refunded, 1), (kept, 4)):
            workers.send("tokens_estimated", label, tenants[label], used)
        time.sleep(0.3)
    got = sorted(e["t"] for e in workers.wait_starts(refunded, 5, timeout=30))
    assert got[-1] - got[0] < 9, f"refunded calls spread over {got[-1] - got[0]:.1f}s: the refunds did not count"
    kept_early = [e for e in workers.starts(kept) if e["t"] - got[0] < 8]
    assert len(kept_early) == 2, "4 tokens a call: 2 a window of 8 tokens"
    done = run_cli(workers, "status", "tests.taskapp.tokens_estimated", "--key", tenants[refunded], "--json")
    assert done.returncode == 0, done.stderr
    (status,) = json.loads(done.stdout)["keys"]
    used = {r["rate"]: r["used"] for r in status["rates"]}
    assert used == {"20/10s": 5, "8 tokens/10s": 5}, used


def test_calls_held_by_their_tokens_come_back_for_starts_reserved_per_rate(workers: WorkerGroup) -> None:
    """20 requests and 8 tokens per 2 s, 4 tokens a call: of 6 sent at once, 2 start, and the
    others are turned away with starts reserved on a count per rate (a header of format 2),
    which they claim when they come back: 2 a window, each once."""
    from tests.helpers import assert_each_ran_once, max_in_window

    label, tenant = new_label(), f"q-{uuid.uuid4().hex[:6]}"
    ids = [workers.send("tokens_quick", label, tenant) for _ in range(6)]
    starts = workers.wait_starts(label, 6, timeout=30)
    assert_each_ran_once(starts, ids)
    times = sorted(e["t"] for e in starts)
    assert max_in_window(times, 2.0 - BODY_DELAY_S) <= 2
    # Each came back for its start and used it: 3 windows, not more (a start that could not
    # be claimed would still count, and push its task a window further)
    assert times[-1] - times[0] < 2 * 2.0 + 1.0, times
    # (Claimed on time, not checked afresh: none went to the back of the line.)
    late = [line for line in workers.log_text().splitlines() if "could not use its reserved start" in line]
    assert not [line for line in late if any(task_id in line for task_id in ids)], late


@pytest.mark.parametrize(("refund", "tokens"), [(True, 300), (False, 400 + 300)], ids=["refunded", "not refunded"])
def test_a_call_refused_with_a_429_is_counted_again_when_it_runs_again(workers: WorkerGroup, refund: bool,
                                                                        tokens: int) -> None:
    """The README's advice for a 429: the failed attempt's estimate (400 tokens) stays
    counted unless the body reports what it used (charge(tokens=0)), and the attempt after
    the back-off is counted again (its estimate, then the 300 it reports)."""
    from celery import Celery

    from tests.helpers import STORE_URL, wait_for

    # Given a call the API refuses once, then serves using 300 tokens
    label, tenant = new_label(), f"r-{uuid.uuid4().hex[:6]}"
    workers.send("refused_once", label, tenant, 300, refund)
    workers.wait_starts(label, 1, timeout=20, settle=0.2)
    # Then both attempts count a request, and the tokens are the second's, plus the
    # first's estimate unless it was refunded
    app = Celery(f"refused-{label}", broker="memory://", set_as_current=False)
    ctl = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=workers.prefix)

    def used() -> dict[str, int]:
        return {str(r.rate): r.used for r in ctl.status("tests.taskapp.refused_once", key=tenant).rates}

    wait_for(lambda: used().get("1000 tokens/m") == tokens, 5, what=f"{tokens} tokens counted, got {used()}")
    assert used() == {"20/m": 2, "1000 tokens/m": tokens}


def test_a_body_brings_its_key_to_the_apis_own_count(workers: WorkerGroup) -> None:
    # Given a key of 10 calls and 1 000 tokens a minute, and a call whose reply says the API
    # has 3 requests and 250 tokens left (another client on the account, calls it counted
    # that the throttle did not see); and one whose reply says more is left than the
    # throttle sees
    label, tenant = new_label(), f"api-{uuid.uuid4().hex[:8]}"
    workers.send("observing", label, tenant, {"x-ratelimit-remaining-requests": "3",
                                              "x-ratelimit-remaining-tokens": "250"})
    first = workers.wait_starts(label, 1, timeout=30, settle=0.2)
    ctl = celery_throttle.Throttle(tasks_app, {"redis_url": STORE_URL, "key_prefix": workers.prefix})
    try:
        status = ctl.status("tests.taskapp.observing", tenant)
        # Then the throttle's windows hold what the API holds (9 and 900 left before)
        assert first[0]["added"] == {"": 6, "tokens": 650}, first[0]
        assert [r.remaining for r in status.rates] == [3, 250], status
        # And a reply that sees more room changes nothing: the count is never lowered
        workers.send("observing", label, tenant, {"x-ratelimit-remaining-requests": "9"})
        second = workers.wait_starts(label, 2, timeout=30, settle=0.2)
        assert [s["added"] for s in second if s["id"] != first[0]["id"]] == [{}]
        assert [r.remaining for r in ctl.status("tests.taskapp.observing", tenant).rates] == [2, 150]
        # And a reply that took longer than a tenth of the minute (the API's count is of its
        # arrival, the window has moved on since) is not read; one of a second is
        late = f"api-{uuid.uuid4().hex[:8]}"
        workers.send("observing", label, late, {"x-ratelimit-remaining-requests": "0"}, 7.0)
        workers.wait_starts(label, 3, timeout=30, settle=0.2)
        workers.send("observing", label, late, {"x-ratelimit-remaining-tokens": "400"}, 1.0)
        third = [s for s in workers.wait_starts(label, 4, timeout=30, settle=0.2) if s.get("tenant") == late]
        assert [s["added"] for s in third] == [{}, {"tokens": 400}], third
        assert [r.remaining for r in ctl.status("tests.taskapp.observing", late).rates] == [8, 400]
    finally:
        ctl.close()


def test_a_reply_that_says_the_api_has_nothing_left_pauses_its_key_until_the_apis_window_resets(
        workers: WorkerGroup) -> None:
    # Given a key far under its own limit (10 calls a minute, one spent), and a reply that
    # says the API has no request left, its window resetting in 3 s (another client spent it)
    label, tenant = new_label(), f"api-{uuid.uuid4().hex[:8]}"
    workers.send("observing", label, tenant, {"x-ratelimit-remaining-requests": "0",
                                              "x-ratelimit-reset-requests": "3s"})
    first = workers.wait_starts(label, 1, timeout=30)[0]
    ctl = celery_throttle.Throttle(tasks_app, {"redis_url": STORE_URL, "key_prefix": workers.prefix})
    try:
        # Then the key is paused until then, for every worker
        until = ctl.paused_until("tests.taskapp.observing", tenant)
        assert until is not None and first["t"] + 2.0 <= until <= first["t"] + 4.0, (until, first["t"])
        # And its next call waits for it, though its own window has room (less the 0.5 s a
        # worker may take to see a pause)
        workers.send("observing", label, tenant, {})
        second = next(s for s in workers.wait_starts(label, 2, timeout=30) if s["id"] != first["id"])
        assert second["t"] >= until - 0.5, (second["t"], until)
        # And what the API counted that the throttle did not (9 calls) left the key's window
        # with the API's reset, not a minute after: 8 of its 10 calls are free
        assert [r.remaining for r in ctl.status("tests.taskapp.observing", tenant).rates] == [8, 800]
    finally:
        ctl.close()


@pytest.mark.pure
def test_charge_outside_a_throttled_body_and_bad_units_fail_clearly() -> None:
    with pytest.raises(ThrottleError, match="in the body of a task with a @throttle"):
        celery_throttle.charge(3)
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ThrottleError, match="integer >= 0"):
            celery_throttle.charge(bad)  # type: ignore[arg-type]
        with pytest.raises(ThrottleError, match="integer >= 0, got tokens="):
            celery_throttle.charge(tokens=bad)  # type: ignore[arg-type]
    for neither_or_both in ((), (3,)):
        with pytest.raises(ThrottleError, match=r"charge\(1234\), or by unit, charge\(tokens=1234\)"):
            celery_throttle.charge(*neither_or_both, **({"tokens": 2} if neither_or_both else {}))


@pytest.mark.pure
def test_charge_in_a_direct_applied_or_eager_call_does_nothing() -> None:
    # Given a task whose body charges its cost (the README's LLM example), in an app no
    # worker runs (a unit test's)
    from celery import Celery

    app = Celery("unit", broker="memory://", set_as_current=False)

    @app.task(name="unit.complete")
    @celery_throttle.throttle("500/m", "30000 tokens/m", cost={"tokens": 100})
    def complete(prompt: str) -> str:
        celery_throttle.charge(tokens=len(prompt))
        return prompt.upper()

    # When it is called directly, applied, or sent with task_always_eager
    app.conf.task_always_eager = True
    # Then charge() does nothing there (nothing was counted), as the throttle does
    assert complete("hi") == "HI"
    assert complete.apply(("hi",)).get() == "HI"
    assert complete.delay("hi").get() == "HI"
