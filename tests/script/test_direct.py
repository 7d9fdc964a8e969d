"""The controller used directly (acquire / status / reset), live limits and pauses, tickets.

These talk to the real Redis but need no worker. (install(), the settings and declaration
errors, which need no Redis, are tests/pure/test_settings.py.)
"""

from __future__ import annotations

import time

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle import ConfigurationError, throttle
from celery_throttle.core.keys import state_key
from celery_throttle.core.protocol import Code, Entry
from celery_throttle.core.spec import ThrottleSpec
from tests.helpers import STORE_URL

STORE = STORE_URL


@pytest.fixture
def ctl(prefix: str, store_client: redis.Redis) -> celery_throttle.Throttle:
    app = Celery("direct", broker="memory://", set_as_current=False)
    return celery_throttle.install(app, redis_url=STORE, key_prefix=prefix)


def test_acquire_admits_up_to_the_limit_then_says_when(ctl: celery_throttle.Throttle) -> None:
    decisions = [ctl.acquire("github-api", key="acme", rates=["3/s"]) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert [d.remaining for d in decisions[:3]] == [2, 1, 0]
    denied = decisions[-1]
    assert 0.9 < denied.retry_after <= 1.1
    assert denied.reset_at > time.time()
    # When the window has moved on, the call is admitted again
    time.sleep(denied.retry_after + 0.02)
    assert ctl.acquire("github-api", key="acme", rates=["3/s"]).allowed


def test_denial_by_one_rate_consumes_nothing_from_the_others(ctl: celery_throttle.Throttle) -> None:
    for _ in range(2):
        assert ctl.acquire("api", rates=["2/s", "100/h"]).allowed
    assert not ctl.acquire("api", rates=["2/s", "100/h"]).allowed
    usage = {str(r.rate): r.used for r in ctl.status("api").rates}
    assert usage == {"2/s": 2, "100/h": 2}


def test_cost_uses_several_units(ctl: celery_throttle.Throttle) -> None:
    assert ctl.acquire("bulk", rates="10/m", cost=7).allowed
    d = ctl.acquire("bulk", rates="10/m", cost=4)
    assert not d.allowed and d.remaining == 3
    assert ctl.acquire("bulk", rates="10/m", cost=3).allowed


def test_rates_of_different_units_count_each_its_own_and_a_denial_consumes_none(
        ctl: celery_throttle.Throttle) -> None:
    # Given an API that allows 2 requests and 10 tokens a minute
    rates = ["2/m", "10 tokens/m"]
    # When calls of 6, then 5, tokens come: the second does not fit the tokens
    assert ctl.acquire("llm", rates=rates, cost={"tokens": 6}).allowed
    denied = ctl.acquire("llm", rates=rates, cost={"tokens": 5})
    # Then it is denied, and counts no request either; a call of 4 tokens fits
    assert not denied.allowed and denied.retry_after > 50
    assert {str(r.rate): r.used for r in ctl.status("llm").rates} == {"2/m": 1, "10 tokens/m": 6}
    assert ctl.acquire("llm", rates=rates, cost={"tokens": 4}).allowed
    assert {str(r.rate): r.used for r in ctl.status("llm").rates} == {"2/m": 2, "10 tokens/m": 10}
    # And a key whose requests are spent denies a call of 1 token, with tokens to spare
    assert [ctl.acquire("llm", key="b", rates=rates, cost={"tokens": 1}).allowed for _ in range(3)] == [True, True,
                                                                                                         False]


@pytest.mark.parametrize("live", [["2/s", "1000 tokens/m", "100000 tokens/d"], ["1500/s", "1000 tokens/m"]],
                         ids=["a rate more", "rates in another order"])
def test_a_task_released_by_unit_is_counted_by_unit_under_a_live_limit_of_other_rates(prefix: str,
                                                                                     live: list[str]) -> None:
    # Given a call of 1 request and 400 tokens under 2/s and 1000 tokens/m, waiting in its
    # line behind two that filled the minute's tokens (a test clock)
    clock = [1_700_000_000_000_000]
    ctl = celery_throttle.Throttle(Celery(f"live-claim-{prefix}", set_as_current=False),
                                   {"redis_url": STORE_URL, "key_prefix": prefix, "default_algorithm": "fixed"},
                                   clock=lambda: clock[0])
    declared = ctl._direct_call("llm", None, ["2/s", "1000 tokens/m"], {"tokens": 400}, None)
    for _ in range(2):
        assert ctl.checker.acquire(declared).allowed
    waiting = ctl.checker.acquire(declared, entry=Entry("t:1", b"m", "t", 0, 0, 1))
    assert waiting.code == Code.QUEUED and declared.cost == (1, 400)
    # When a live limit changes the rates (one more, or another order) before it is
    # released and arrives
    ctl.set_limit("llm", live)
    now = ctl.checker.live(declared)
    clock[0] += 60_000_000
    released = ctl.checker.release(now, 8)
    assert [(r.id, r.kind) for r in released.reported] == [("t:1", "r")]
    again = ctl.checker.claim(now, "t:1", holder="h")
    # Then it is counted by unit under the rates of now: 400 tokens, 1 request (no error,
    # no unit taken from the wrong rate)
    used = {str(r.rate): r.used for r in ctl.status("llm").rates}
    assert again.code == Code.RUN and used["1000 tokens/m"] == 400 and used[live[0]] == 1, (again, used)


def test_a_cost_by_unit_is_checked_against_the_rates_that_count_it(ctl: celery_throttle.Throttle) -> None:
    with pytest.raises(ConfigurationError, match="that no rate counts"):
        ctl.acquire("llm", rates=["3/m"], cost={"tokens": 2})
    with pytest.raises(ConfigurationError, match="positive integer"):
        ctl.acquire("llm", rates=["3/m", "10 tokens/m"], cost={"tokens": 0})
    with pytest.raises(celery_throttle.ThrottleError, match="exceeds the limit of its rate 10 tokens/m"):
        ctl.acquire("llm", rates=["3/m", "10 tokens/m"], cost={"tokens": 11})


def test_a_live_limit_of_named_units_keeps_each_units_count(prefix: str) -> None:
    ctl = celery_throttle.install(Celery(f"live-units-{prefix}", set_as_current=False),
                                  redis_url=STORE_URL, key_prefix=prefix)
    rates, cost = ["5/m", "100 tokens/m"], {"tokens": 40}
    assert ctl.acquire("llm", rates=rates, cost=cost).allowed
    # A live limit of the same windows: each keeps what its unit counted (1 request, 40 tokens)
    assert ctl.set_limit("llm", ["2/m", "60 tokens/m"]) == tuple(celery_throttle.parse_rate(r)
                                                                for r in ["2/m", "60 tokens/m"])
    denied = ctl.acquire("llm", rates=rates, cost=cost)
    assert not denied.allowed
    assert {str(r.rate): r.used for r in ctl.status("llm").rates} == {"2/m": 1, "60 tokens/m": 40}
    assert ctl.acquire("llm", rates=rates, cost={"tokens": 20}).allowed
    assert not ctl.acquire("llm", rates=rates, cost={"tokens": 1}).allowed  # 2 requests of 2


def test_keys_partition_the_limit(ctl: celery_throttle.Throttle) -> None:
    assert ctl.acquire("export", key="a", rates="1/m").allowed
    assert ctl.acquire("export", key="b", rates="1/m").allowed
    assert not ctl.acquire("export", key="a", rates="1/m").allowed
    assert not ctl.acquire("export", rates="1/m", key="b").allowed
    assert ctl.acquire("export", rates="1/m").allowed  # no key: the scope's own limit


def test_fixed_window_resets_at_the_aligned_boundary(ctl: celery_throttle.Throttle) -> None:
    for _ in range(2):
        assert ctl.acquire("f", rates="2/s", algorithm="fixed").allowed
    d = ctl.acquire("f", rates="2/s", algorithm="fixed")
    assert not d.allowed
    boundary = d.reset_at
    assert boundary == int(boundary)  # aligned on a whole second (Redis clock)
    assert abs(time.time() + d.retry_after - boundary) < 0.05


def test_status_and_reset(ctl: celery_throttle.Throttle) -> None:
    assert ctl.status("s", key="k").rates == ()
    ctl.acquire("s", key="k", rates=["5/s", "50/h"], cost=2)
    status = ctl.status("s", key="k")
    assert {(str(r.rate), r.used, r.remaining) for r in status.rates} == {("5/s", 2, 3), ("50/h", 2, 48)}
    assert status.remaining == 3
    # status consumed nothing
    assert ctl.status("s", key="k").remaining == 3
    assert ctl.reset("s", key="k") is True
    assert ctl.status("s", key="k").rates == ()
    assert ctl.reset("s", key="k") is False


def test_every_key_has_the_prefix_and_a_ttl(ctl: celery_throttle.Throttle, prefix: str,
                                            store_client: redis.Redis) -> None:
    ctl.acquire("ttl", key="x", rates=["5/s", "10/m"])
    keys = list(store_client.scan_iter(match=f"{prefix}*"))
    assert keys == [f"{prefix}:{{ttl:x}}".encode()]
    # until the last unit leaves the 1-minute window, + 1 s margin, + 1 s (shortest
    # window) of headroom
    assert 59_000 < store_client.pttl(keys[0]) <= 62_100


def test_direct_use_rejects_bad_input_clearly(ctl: celery_throttle.Throttle) -> None:
    with pytest.raises(ConfigurationError, match="bad rate"):
        ctl.acquire("x", rates="10 per second")
    with pytest.raises(ConfigurationError, match="algorithm"):
        ctl.acquire("x", rates="1/s", algorithm="token-bucket")
    with pytest.raises(ConfigurationError, match="cost"):
        ctl.acquire("x", rates="1/s", cost=0)
    with pytest.raises(celery_throttle.ThrottleError, match="exceeds the limit"):
        ctl.acquire("x", rates="2/s", cost=3)


def test_eager_and_direct_calls_are_not_throttled(prefix: str) -> None:
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    celery_throttle.install(app, redis_url=STORE, key_prefix=prefix)

    @throttle("1/h")
    @app.task
    def once(x):
        return x

    assert [once.delay(i).get() for i in range(3)] == [0, 1, 2]
    assert once(5) == 5


def test_a_ticket_starts_one_body_and_a_forged_or_copied_one_is_a_new_task(ctl: celery_throttle.Throttle) -> None:
    # Given a full 2/s window and two tasks waiting in its line
    call = ctl._direct_call("once", None, "2/s", 1, None)
    assert ctl.checker.acquire(call).allowed and ctl.checker.acquire(call).allowed
    for n in (1, 2):
        assert ctl.checker.acquire(call, entry=Entry(f"task-{n}:x{n}", b"m", f"task-{n}", 0, 0, 1)).code == Code.QUEUED
    # When the window has room again and the first is released, and arrives
    time.sleep(1.05)
    released = ctl.checker.release(call, 1)
    assert [r.id for r in released.reported] == ["task-1:x1"]
    first = ctl.checker.claim(call, "task-1:x1", holder="h1")
    # Then it runs on its ticket; a copy of its message (the same ticket again) is known
    # as one that started (dropped, not run twice), and a ticket nobody was handed is
    # checked as a new task: with the second one still waiting in the line, it does not
    # start, and does not wait without its message
    assert first.allowed
    assert ctl.checker.claim(call, "task-1:x1", holder="h2").code == Code.DUPLICATE
    guessed = ctl.checker.claim(call, "task-2:guessed", holder="h2")
    assert guessed.code == Code.DENIED and guessed.waiting == 1


def test_a_live_limit_applies_to_every_key_without_its_own_and_keeps_what_was_counted(prefix: str) -> None:
    from celery import Celery

    ctl = celery_throttle.install(Celery(f"live-{prefix}", set_as_current=False),
                                  redis_url=STORE_URL, key_prefix=prefix)
    for _ in range(3):
        assert ctl.acquire("api", key="acme", rates=["10/s"]).allowed
    # A scope-wide limit of the same window length keeps the 3 counted
    ctl.set_limit("api", ["4/s"])
    assert [ctl.acquire("api", key="acme", rates=["10/s"]).allowed for _ in range(2)] == [True, False]
    # a key's own limit wins over the scope's
    ctl.set_limit("api", ["6/s"], key="acme")
    assert ctl.acquire("api", key="acme", rates=["10/s"]).allowed
    assert ctl.acquire("api", key="other", rates=["10/s"]).remaining == 3  # 4/s for the others
    # a window of another length starts empty (and the declared 10/s stays in force beside it)
    ctl.set_limit("api", ["1/m"], key="acme")
    assert ctl.acquire("api", key="acme", rates=["10/s"]).allowed
    assert not ctl.acquire("api", key="acme", rates=["10/s"]).allowed
    # and clearing brings back the code's rates
    assert ctl.clear_limit("api", key="acme") and ctl.clear_limit("api")
    assert ctl.acquire("api", key="acme", rates=["10/s"]).remaining == 10 - 3 - 1 - 1 - 1 - 1
    with pytest.raises(ConfigurationError):
        ctl.set_limit("api", ["fast"])


def test_a_live_concurrency_limit_is_set_read_and_cleared_and_bad_ones_are_refused(prefix: str,
                                                                                    store_client: redis.Redis) -> None:
    ctl = celery_throttle.install(Celery(f"live-k-{prefix}", set_as_current=False),
                                  redis_url=STORE_URL, key_prefix=prefix)
    # A K for the scope, and one of its own for a key; rates left as the code has them
    assert ctl.set_limit("export-api", concurrency=4) == ()
    ctl.set_limit("export-api", key="acme", concurrency=1)
    assert (ctl.status("export-api").concurrency, ctl.status("export-api", "acme").concurrency,
            ctl.status("export-api", "other").live_concurrency) == (4, 1, 4)
    assert ctl.live_limit("export-api") is None  # (no live rates)
    # A bind of a call of that scope takes it, with rates or without
    assert ctl.checker.live(ctl._direct_call("export-api", "acme", "5/s", 1, None)).concurrency == 1
    # Cleared, the code's K is back
    assert ctl.clear_limit("export-api", key="acme") and ctl.status("export-api", "acme").live_concurrency == 4
    assert ctl.clear_limit("export-api") and ctl.status("export-api").live_concurrency is None
    for bad in (0, -2, True, "4", 2.5):
        with pytest.raises(ConfigurationError, match="concurrency must be a positive integer"):
            ctl.set_limit("export-api", concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="rates, a concurrency, or both"):
        ctl.set_limit("export-api")
    # A K written by hand that does not read is skipped, not fatal
    store_client.hset(f"{prefix}:control", "slots:export-api", "many")
    assert ctl.status("export-api").live_concurrency is None


def test_a_live_limit_keeps_what_the_declared_sliding_rate_counted_in_the_workers_check(prefix: str) -> None:
    # Given a sliding 10/s task (the default margin widens its window), 3 of whose calls ran
    # through the check a worker makes
    ctl = celery_throttle.install(Celery(f"live-bind-{prefix}", set_as_current=False),
                                  redis_url=STORE_URL, key_prefix=prefix)
    spec = ThrottleSpec.declare(["10/s"], scope="api")

    def check() -> bool:
        return ctl.checker.acquire(ctl.checker.bind_spec("t", spec, None, (), {})).allowed

    assert all(check() for _ in range(3))
    # When a live limit of the same window lowers it to 4/s
    ctl.set_limit("api", ["4/s"])
    # Then what was counted still counts under it: one more fits, not four
    assert [check() for _ in range(2)] == [True, False]


def test_a_start_granted_early_is_used_only_if_the_process_wakes_in_time(ctl: celery_throttle.Throttle) -> None:
    from celery_throttle.core.protocol import WindowReply
    from celery_throttle.integration.hook import _waited_for_start

    call = ctl._direct_call("api", None, "10/s", 1, None)
    slack = ctl.checker.slack_us(call.rates)

    def granted(wait_us: int, open_us: int) -> WindowReply:
        start = 1_700_000_000_000_000
        return WindowReply(Code.RUN_AT, wait_us, 0, 0, start - wait_us, 1, start_us=start, latest_us=start + open_us)

    # A start open 50 ms beyond the slack: a process that waits 5 ms for it is in time
    assert _waited_for_start(ctl, call, granted(5_000, slack + 50_000))
    # One whose span leaves no room past the slack: any waking is too late to use it
    assert not _waited_for_start(ctl, call, granted(5_000, slack - 1))


def test_concurrent_pauses_keep_the_longest_and_forget_those_over(ctl: celery_throttle.Throttle) -> None:
    import threading

    from celery_throttle.check.control_fields import pause_field

    # Given a pause that is over, and a live limit, in the controls hash
    store = ctl.store
    over = pause_field("old", None)
    store.set_control(over, str(store.now_us() - 1_000_000))
    ctl.set_limit("api", ["4/s"])
    # When 8 threads pause one scope at once, each for its own length (a read, then a
    # write, would let a shorter pause land after the longest)
    lengths = [30.0 + i for i in range(8)]
    start = threading.Barrier(len(lengths))

    def pause(seconds: float) -> None:
        start.wait()
        ctl.store.pause(pause_field("vendor", None), seconds)

    threads = [threading.Thread(target=pause, args=(s,)) for s in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then the longest stays, and the limit stays; the first process to read the controls
    # forgets the pause that was over
    controls = store.controls()
    assert int(controls[pause_field("vendor", None)]) - store.now_us() > (max(lengths) - 5) * 1_000_000
    assert controls["limit:api"] == "4/s"
    ctl.checker.refresh_controls()
    controls = store.controls()
    assert over not in controls and controls["limit:api"] == "4/s"
    # and a shorter pause set after it does not shorten it; one with no end is forever
    assert store.pause(pause_field("vendor", None), 1.0) == int(controls[pause_field("vendor", None)])
    assert store.pause(pause_field("vendor", None), None) == celery_throttle.core.state.FOREVER_US
    ctl.close()  # (the threads' connections)


def test_status_shows_each_rate_as_declared_whatever_margin_it_is_counted_with(prefix: str) -> None:
    # Given a task declared with a margin of its own, one throttled by a rule with a
    # margin, and one by a rule with the default margin
    app = Celery(f"margins-{prefix}", broker="memory://", set_as_current=False)
    app.conf.throttle_rules = {"vendor.charge": {"rate": "3/s", "margin": 0.05},
                               "vendor.refund": {"rate": ["3/s", "100/h"], "scope": "refunds"}}
    ctl = celery_throttle.install(app, redis_url=STORE, key_prefix=prefix)

    @app.task(name="reports.export")
    @throttle("5/s", margin=0.2)
    def export() -> None: ...

    @app.task(name="vendor.charge")
    def charge() -> None: ...

    @app.task(name="vendor.refund")
    def refund() -> None: ...

    # (the task objects themselves: nothing finalizes the app, as a producer never does)
    for name, task in (("reports.export", export), ("vendor.charge", charge), ("vendor.refund", refund)):
        known = ctl.checker.known(app, name, task)
        assert known is not None
        call = ctl.checker.bind_spec(name, known.spec, known.signature, (), {})
        assert ctl.checker.acquire(call).allowed
    assert not app.finalized
    # Then status shows the rates as declared (the windows counted are 1.2 s, 1.05 s, 1.02 s
    # and 3600.02 s)
    shown = {scope: [str(r.rate) for r in ctl.status(scope).rates]
             for scope in ("reports.export", "vendor.charge", "refunds")}
    assert shown == {"reports.export": ["5/s"], "vendor.charge": ["3/s"], "refunds": ["3/s", "100/h"]}


def test_a_process_reads_the_control_hash_whole_only_when_its_stamp_moved(
        ctl: celery_throttle.Throttle, store_client: redis.Redis, prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_throttle.check import controls
    from celery_throttle.core import state

    # Given a stamped control hash (a pause set through the API) this process has read
    ctl.pause("vendor", seconds=60)
    ctl.checker.refresh_controls()
    # When a live limit is written by hand, without moving the stamp
    store_client.hset(f"{prefix}:control", "limit:vendor", "3/s")
    # Then a read of the stamp alone does not see it
    ctl.checker.refresh_controls()
    assert ctl.checker.controls.rates_for(ctl.store, "vendor", None, ()) == ()
    # but a read past FULL_READ_EVERY does, and any stamped write at once
    monkeypatch.setattr(controls, "FULL_READ_EVERY", 0.0)
    ctl.checker.refresh_controls()
    assert [str(r) for r in ctl.checker.controls.rates_for(ctl.store, "vendor", None, ())] == ["3/s"]
    monkeypatch.setattr(controls, "FULL_READ_EVERY", 60.0)
    store_client.hset(f"{prefix}:control", "limit:vendor", "5/s")
    store_client.hincrby(f"{prefix}:control", state.CONTROL_STAMP, 1)  # (another process's write)
    ctl.checker.refresh_controls()
    assert [str(r) for r in ctl.checker.controls.rates_for(ctl.store, "vendor", None, ())] == ["5/s"]
    # And a hash no write ever stamped (written by hand, or its stamp evicted) is read whole every time
    store_client.hdel(f"{prefix}:control", state.CONTROL_STAMP)
    store_client.hset(f"{prefix}:control", "limit:vendor", "7/s")
    ctl.checker.refresh_controls()
    assert [str(r) for r in ctl.checker.controls.rates_for(ctl.store, "vendor", None, ())] == ["7/s"]


def test_a_state_field_written_by_hand_that_names_no_rate_is_skipped_by_status(
        ctl: celery_throttle.Throttle, store_client: redis.Redis, prefix: str) -> None:
    # Given a key that counted a call, and fields written by hand into its state hash that
    # look like a rate's but name none (digits other than ASCII, a limit or window of 0)
    ctl.acquire("hand-api", rates=["5/s"])
    hash_key = state_key(prefix, "hand-api", None)
    store_client.hset(hash_key, mapping={"s\u00b2/100": b"", "s10/0": b"", "f0/1000000": b""})
    # Then status shows the one rate counted, and reads the rest as no rate (no traceback)
    shown = ctl.status("hand-api")
    assert [(str(r.rate), r.used) for r in shown.rates] == [("5/s", 1)], shown


def test_a_lease_taken_in_one_thread_is_given_up_from_another_and_a_lost_one_says_so(
        ctl: celery_throttle.Throttle, store_client: redis.Redis, prefix: str) -> None:
    import threading

    # Given a lease one thread took (a sharer's), given up from another (its worker stopping)
    lock = ctl.store.lock(f"{prefix}:lease-test", 30.0)
    taker = threading.Thread(target=lambda: lock.acquire())
    taker.start()
    taker.join()
    assert store_client.exists(f"{prefix}:lease-test")
    lock.release()
    # Then it is free for the next process at once, not after its lease
    assert not store_client.exists(f"{prefix}:lease-test")
    other = ctl.store.lock(f"{prefix}:lease-test", 30.0)
    assert other.acquire() and other.renew()
    # And a lease another took meanwhile is lost: renew says so, release leaves it be
    store_client.set(f"{prefix}:lease-test", "someone else")
    assert not other.renew()
    other.release()
    assert store_client.get(f"{prefix}:lease-test") == b"someone else"
    store_client.delete(f"{prefix}:lease-test")


#: A holder's nonce, as a process makes them (slots.is_nonce).
NONCE = "0a1b2c3d4e5f6a7b"


def test_a_redelivered_task_sent_back_after_a_store_error_goes_as_a_new_task_not_as_a_copy(prefix: str) -> None:
    from celery.app.task import Context
    from celery.signals import before_task_publish

    from celery_throttle.core.errors import StoreError
    from celery_throttle.core.header import HEADER, Header
    from celery_throttle.waits.deferral import TurnedAway

    app = Celery("redelivered", broker="memory://", set_as_current=False)
    ctl = celery_throttle.install(app, redis_url=STORE_URL, key_prefix=prefix)

    @app.task(name="redelivered.job", shared=False)
    @throttle("1/m", scope="redelivered-api")
    def job(x: int) -> None: ...

    import inspect

    from celery_throttle.core.spec import declared_spec

    spec = declared_spec(job)
    assert spec is not None
    call = ctl.checker.bind_spec(job.name, spec, inspect.signature(job.run), (1,), {})
    released = Header(call.state_key, "ticket-1:abc", 1)
    sent: list[Header] = []

    def capture(headers: dict, **_: object) -> None:
        sent.append(Header.read(headers.get(HEADER)))

    before_task_publish.connect(capture, weak=False)
    try:
        for redelivered in (True, False):
            # Given a task released with its ticket, delivered again by the broker (its worker died
            # holding the start granted to it), or not, whose claim meets a store error
            request = Context(id="t-1", task="redelivered.job", args=[1], kwargs={},
                              headers={HEADER: released.value()},
                              delivery_info={"redelivered": redelivered, "exchange": "", "routing_key": "q"})
            turned = TurnedAway(ctl.setup, ctl.lines, job, request, (1,), {}, call, released,
                                holder=f"t-1@1:{NONCE}")
            turned.entry(with_message=False)  # (its claim's entry: its ticket)
            # When it is sent back for a moment
            assert turned.on_store_error(StoreError("the store went away")) is False
    finally:
        before_task_publish.disconnect(capture)
    # Then the redelivered one goes as the new task its pool checks it as: no ticket, an entry
    # of its own (with its ticket, the start its dead worker held would drop it as a copy)
    new, kept = sent
    assert new.ticket == "" and new.pending not in ("", "ticket-1:abc") and new.lost == NONCE
    # and one delivered once keeps its ticket, to be claimed with it
    assert kept.ticket == "ticket-1:abc" and kept.pending == "ticket-1:abc"
    ctl.close()
