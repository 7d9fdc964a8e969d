"""``celery -A proj throttle ...``, through the real celery command."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest
import redis

import celery_throttle
from tests.helpers import BROKER_URL, ROOT, free_port
from tests.taskapp import app


def _run(prefix: str, *args: str, store: str | None = None, queue: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CT_PREFIX=prefix, PYTHONPATH=str(ROOT))
    if store:
        env["CT_STORE"] = store
    if queue:
        env["CT_QUEUE"] = queue
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)  # (a question asked is answered by nothing: no)


def _celery(prefix: str, *args: str, queue: str | None = None) -> str:
    out = _run(prefix, *args, queue=queue)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_reset_and_parked_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("github-api", key="acme", rates=["10/m", "100/h"], cost=3)
    out = _celery(prefix, "status", "github-api", "--key", "acme")
    assert _row(out, "github-api", "acme", "10/m") == ["3", "7"]
    assert _row(out, "", "", "100/h") == ["3", "97"]
    assert "no task waits in a line" in _celery(prefix, "parked")
    declined = _run(prefix, "reset", "github-api", "--key", "acme")  # asks first; no answer: nothing reset
    assert declined.returncode != 0 and ctl.status("github-api", key="acme").rates
    assert "reset scope 'github-api' key 'acme'" in _celery(prefix, "reset", "github-api", "--key", "acme", "--yes")
    # Nothing left, and no task of the app uses that scope: said, not a blank table
    gone = _run(prefix, "status", "github-api", "--key", "acme")
    assert gone.returncode == 1 and "nothing counted, paused or limited" in gone.stderr


def _row(out: str, *head: str) -> list[str]:
    """The used and left cells of the table row that starts with ``head`` (blank cells of
    a continued row given as "")."""
    for line in out.splitlines():
        cells = line.split()
        named = [h for h in head if h]
        if cells[:len(named)] == named and (head[0] or line.startswith(" ")):
            return cells[len(named):len(named) + 2]
    raise AssertionError(f"no row {head} in:\n{out}")


def test_status_lists_every_scope_with_its_pauses_and_live_limits_and_as_json(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("github-api", key="acme", rates=["10/m"], cost=3)
    ctl.acquire("github-api", key="globex", rates=["10/m"], cost=1)
    ctl.acquire("exports", rates=["5/m"], cost=2)
    ctl.pause("vendor", key="acme")
    out = _celery(prefix, "status")
    assert _row(out, "github-api", "acme", "10/m") == ["3", "7"]
    assert _row(out, "github-api", "globex", "10/m") == ["1", "9"]
    assert _row(out, "exports", "-", "5/m") == ["2", "3"]
    # (an open-ended pause reads as one: "paused: until resumed", never as "resumed")
    assert next(line for line in out.splitlines() if line.startswith("vendor")).rstrip().endswith("until resumed")
    assert out.splitlines()[0].split()[-1] == "paused"
    assert all(len(line) <= 80 for line in out.splitlines())
    only = _celery(prefix, "status", "--match", "github*")
    assert "exports" not in only and "globex" in only
    data = json.loads(_celery(prefix, "status", "--json", "--match", "exports"))
    assert [(k["scope"], k["key"]) for k in data["keys"]] == [("exports", None)]
    assert data["keys"][0]["rates"][0]["used"] == 2 and data["dead_letters"] == 0
    assert data["keys"][0]["rates"][0]["reset_at"][-6] in "+-"  # a zone with every time
    # Every time field of --json is a time or null; an open-ended pause has a flag of its own
    vendor = json.loads(_celery(prefix, "status", "--json", "--match", "vendor"))["keys"][0]
    assert (vendor["paused"], vendor["paused_until"], vendor["paused_until_resumed"]) == (True, None, True)
    assert (data["keys"][0]["paused"], data["keys"][0]["paused_until"]) == (False, None)


def test_a_misspelt_scope_is_an_error_that_lists_the_known_ones(prefix: str) -> None:
    out = _run(prefix, "status", "githb-api")
    assert out.returncode != 0
    assert "no such scope 'githb-api'" in out.stderr and "shared-api" in out.stderr


def test_an_unreachable_store_is_one_line_of_error_not_a_traceback(prefix: str) -> None:
    # Given a store nobody listens on
    out = _run(prefix, "status", "github-api", store=f"redis://127.0.0.1:{free_port()}/0")
    # Then the command fails with one line that says what and where
    assert out.returncode == 1
    assert out.stderr.startswith("Error: Redis at redis://127.0.0.1:"), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_set_says_which_rates_are_in_force_and_replace_lifts_the_other_windows(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("replaced-api", rates=["6/s", "9/30s"], cost=2)
    # Given the scope its tasks declare 6/s and 9/30s for, when 2/s is set live
    out = _celery(prefix, "set", "replaced-api", "2/s")
    # Then the 9/30s stays in force, and the command says so
    assert out.splitlines() == ["scope 'replaced-api': limit set to 2/s", "in force: 2/s (live), 9/30s (declared)"]
    ctl.acquire("replaced-api", rates=["6/s", "9/30s"], cost=2)
    assert sum(map(int, _row(_celery(prefix, "status", "replaced-api"), "", "", "9/30s"))) == 9
    # When set with --replace: the 9/30s is lifted, said when set and in status
    out = _celery(prefix, "set", "replaced-api", "2/s", "--replace")
    assert out.splitlines() == ["scope 'replaced-api': limit set to 2/s in place of every declared rate",
                                "in force: 2/s (live); lifted until `throttle unset`: 9/30s"]
    ctl.acquire("replaced-api", rates=["6/s", "9/30s"], cost=2)  # (counted by the 2/s alone now)
    status = _celery(prefix, "status", "replaced-api")
    assert sum(map(int, _row(status, "", "", "9/30s", "(not", "in", "force)"))) == 9, status
    assert json.loads(_celery(prefix, "status", "replaced-api", "--json"))["keys"][0]["live_replaces_all"] is True
    assert "back to the code's limits" in _celery(prefix, "unset", "replaced-api")
    assert ctl.store.controls() == {}


def test_pause_and_resume_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    out = _celery(prefix, "pause", "github-api", "--key", "acme", "--for", "90s")
    assert out.startswith("paused scope 'github-api' key 'acme' until ")
    assert ctl.status("github-api", key="acme").paused_until is not None
    until = dt.datetime.fromtimestamp(ctl.status("github-api", key="acme").paused_until).astimezone()
    row = _celery(prefix, "status", "github-api", "--key", "acme").splitlines()[1]
    assert row.split()[:2] == ["github-api", "acme"] and row.rstrip().endswith(f"until {until:%H:%M:%S}"), row
    timed = json.loads(_celery(prefix, "status", "github-api", "--key", "acme", "--json"))["keys"][0]
    assert dt.datetime.fromisoformat(timed["paused_until"]).timestamp() == pytest.approx(until.timestamp(), abs=0.001)
    assert timed["paused_until_resumed"] is False
    assert ctl.status("github-api", key="other").paused_until is None  # the key only
    assert "paused scope 'github-api' until resumed" in _celery(prefix, "pause", "github-api")
    assert "resumed scope 'github-api'\n" in _celery(prefix, "resume", "github-api")
    assert "resumed scope 'github-api' key 'acme'" in _celery(prefix, "resume", "github-api", "--key", "acme")
    assert "was not paused" in _celery(prefix, "resume", "github-api", "--key", "acme")
    bad = _run(prefix, "pause", "github-api", "--for", "soon")
    assert bad.returncode != 0 and "use e.g. 90s, 5m, 2h, 1d" in bad.stderr


def test_set_and_unset_a_live_limit_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("github-api", rates=["10/m"], cost=3)
    assert "scope 'github-api': limit set to 4/m" in _celery(prefix, "set", "github-api", "4/m")
    out = _celery(prefix, "status", "github-api")
    # What was counted under the declared 10/m still counts under the live 4/m
    assert _row(out, "github-api", "-", "4/m", "(live)") == ["3", "1"]
    assert "back to the code's limits" in _celery(prefix, "unset", "github-api")
    assert "no live limit set" in _celery(prefix, "unset", "github-api")
    bad = _run(prefix, "set", "github-api", "fast")
    assert bad.returncode != 0 and "bad rate 'fast'" in bad.stderr and "Traceback" not in bad.stderr
    # Rates of named units and a concurrency limit, together or alone
    both = _celery(prefix, "set", "llm", "500/m", "30000 tokens/m", "--concurrency", "3")
    assert both.splitlines()[0] == "scope 'llm': limit set to 500/m, 30000 tokens/m; concurrency set to 3"
    as_json = json.loads(_celery(prefix, "status", "llm", "--json"))["keys"][0]
    assert as_json["live_limit"] == ["500/m", "30000 tokens/m"] and as_json["live_concurrency"] == 3
    assert _celery(prefix, "set", "llm", "--key", "acme", "--concurrency", "1").strip() == \
        "scope 'llm' key 'acme': concurrency set to 1"
    assert "back to the code's limits" in _celery(prefix, "unset", "llm", "--key", "acme")
    assert "back to the code's limits" in _celery(prefix, "unset", "llm")
    for args in (("set", "llm"), ("set", "llm", "--concurrency", "0"), ("set", "llm", "--concurrency", "2", "--replace")):
        refused = _run(prefix, *args)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr


def _three_waiting(prefix: str) -> celery_throttle.Throttle:
    """A controller of ``prefix`` whose lines hold task-0 and task-1 (scope "exports" key
    "acme") and task-2 (scope "github-api"), their hourly windows spent."""
    from celery_throttle.celery_parts.messages import encode_message
    from celery_throttle.core.protocol import Code, Entry

    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    for i, (scope, key) in enumerate([("exports", "acme"), ("exports", "acme"), ("github-api", None)]):
        call = ctl._direct_call(scope, key, "1/h", 1, None)
        ctl.checker.acquire(call)
        sig = app.signature("tests.taskapp.below", args=(f"p{i}",), task_id=f"task-{i}")
        entry = Entry(f"task-{i}:e", encode_message(app, sig), f"task-{i}", 0, 0, 8)
        assert ctl.checker.acquire(call, entry=entry).code == Code.QUEUED
    return ctl


def test_waiting_tasks_by_scope_and_key_and_a_purge(prefix: str) -> None:
    # Given three tasks waiting in the lines of two keys whose hourly windows are spent
    ctl = _three_waiting(prefix)
    # Then `parked` says how many wait in each line, and lists them with --tasks
    out = _celery(prefix, "parked")
    assert "scope 'exports' key 'acme': 2 waiting, 0 released, the oldest since " in out, out
    assert "scope 'github-api': 1 waiting, 0 released" in out, out
    listed = _celery(prefix, "parked", "--tasks", "--match", "github*")
    assert "task-2  tests.taskapp.below  scope 'github-api'  place 1  since " in listed and "task-0" not in listed
    # and a purge of one key's line deletes those alone, asking first
    assert "purged 2 waiting task(s)" in _celery(prefix, "parked", "--purge", "--match", "exports", "--key-match",
                                                  "acme", "--yes")
    assert [w.task_id for w in ctl.lines.waiting()] == ["task-2"]
    declined = _run(prefix, "parked", "--purge")  # asks first; no answer: nothing deleted
    assert declined.returncode != 0 and [w.task_id for w in ctl.lines.waiting()] == ["task-2"]


def test_send_now_empties_the_lines_into_the_broker_before_a_rollback(prefix: str) -> None:
    from celery_throttle.core.header import HEADER, Header

    # Given two tasks waiting in the line of a key whose hourly window is spent, and one in
    # another key's
    ctl = _three_waiting(prefix)
    queue, broker = f"{prefix}-q", redis.Redis.from_url(BROKER_URL)
    try:
        # When an operator sends the line of "exports" on now (it asks first: with no
        # answer, nothing is sent)
        declined = _run(prefix, "parked", "--send-now", "--match", "exports", queue=queue)
        assert declined.returncode != 0 and broker.llen(queue) == 0
        out = _celery(prefix, "parked", "--send-now", "--match", "exports", "--yes", queue=queue)
        # Then both are in the broker's queue, each once, with its id and its ticket (a
        # worker of a version without lines checks it as a new task), and only the other
        # key's task still waits in a line
        assert "sent 2 waiting task(s) to their queues" in out, out
        messages = [json.loads(m) for m in broker.lrange(queue, 0, -1)]
        assert sorted(m["headers"]["id"] for m in messages) == ["task-0", "task-1"]
        assert all(Header.read(m["headers"][HEADER]).ticket for m in messages)
        assert [w.task_id for w in ctl.lines.waiting() if w.place] == ["task-2"]
        assert "no waiting task to send" in _celery(prefix, "parked", "--send-now", "--match", "exports", "--yes")
    finally:
        # (the queue, and the bindings kombu's Redis transport declared for it)
        for name in broker.scan_iter(match=f"*{queue}*", count=1000):
            broker.delete(name)
        broker.close()


def test_status_prints_hostile_keys_as_text_and_lists_the_keys_of_a_scope(prefix: str) -> None:
    # Given a tenant-keyed scope whose keys are user data that looks like rich markup
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    hostile = ["[/]", "[red]acme", "a:b[bold]", "[link=x]y[/link]"]
    for key in hostile:
        for _ in range(5):
            ctl.acquire("tenants:api", key=key, rates=["5/m"])
    # When the whole listing, and then the scope alone, are shown
    listing, scoped = _run(prefix, "status"), _run(prefix, "status", "tenants:api")
    # Then neither fails, and each key is printed as it is, at 5 of 5
    for out in (listing, scoped):
        assert out.returncode == 0, out.stderr
        for key in hostile:
            assert key in out.stdout, out.stdout
        assert "nothing counted" not in out.stdout


def test_match_selects_scope_and_key_apart_when_both_hold_a_colon(prefix: str) -> None:
    # Given scope "a:b" key "c" and scope "a" key "b:c" (one glob over "scope:key" is
    # "a:b:c" for both)
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("a:b", key="c", rates=["5/m"])
    ctl.acquire("a", key="b:c", rates=["5/m"])
    ctl.acquire("a", key="d", rates=["5/m"])

    def listed(*args: str) -> list[tuple[str, str]]:
        data = json.loads(_celery(prefix, "status", "--json", *args))
        return [(k["scope"], k["key"]) for k in data["keys"]]

    # Then each glob selects one part, and each pair is told apart
    assert listed("--match", "a:b") == [("a:b", "c")]
    assert listed("--match", "a", "--key-match", "b:c") == [("a", "b:c")]
    assert listed("--match", "a", "--key-match", "b*") == [("a", "b:c")]
    assert listed("--key-match", "c") == [("a:b", "c")]
    assert listed("a", "--key-match", "d") == [("a", "d")]
    # A glob in the shape keys are shown in, scope:key, that no scope matches: each split
    # at a colon is tried as scope and key, and the output says how it was read
    assert listed("--match", "a:d") == [("a", "d")]
    assert listed("--match", "a:b:c") == [("a", "b:c"), ("a:b", "c")]  # (both pairs shown as a:b:c)
    said = _celery(prefix, "status", "--match", "a:d")
    assert said.splitlines()[0] == "no scope matches 'a:d'; shown: the keys it names, as --match 'a' --key-match 'd'"
    # and one that matches nothing says so, and how a key is selected
    nothing = _celery(prefix, "status", "--match", "a:x")
    assert nothing.strip() == ("nothing matched --match 'a:x' (--match selects scopes, --key-match keys: a key of a "
                               "scope is --match 'a' --key-match 'x')")


def test_operator_commands_print_their_result_once(prefix: str) -> None:
    # Given nothing paused; when a scope is paused and a limit set from the shell
    paused = _run(prefix, "pause", "vendor", "--key", "[x]", "--for", "5m")
    limited = _run(prefix, "set", "vendor", "3/s")
    # Then each says what it did once, on stdout, with the key it was given (or none)
    assert paused.stdout.count("paused") == 1 and "key '[x]'" in paused.stdout
    assert limited.stdout.splitlines() == ["scope 'vendor': limit set to 3/s",
                                           "in force: 3/s (live) (no task of this app declares rates for it)"]
    assert "paused" not in paused.stderr and "limit" not in limited.stderr
    _celery(prefix, "resume", "vendor", "--key", "[x]")
    _celery(prefix, "unset", "vendor")


def test_reset_of_a_keyed_scope_says_what_it_did_and_all_keys_resets_every_key(prefix: str) -> None:
    # Given a scope whose windows are all per key
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    for key in ("acme", "globex"):
        ctl.acquire("exports", key=key, rates=["5/m"], cost=2)
    # When the scope alone is reset, nothing is, and it says how to reset the keys
    out = _celery(prefix, "reset", "exports", "--yes")
    assert "scope 'exports': nothing to reset (its keys have windows of their own: --key KEY, or --all-keys)" in out
    assert ctl.status("exports", key="acme").rates[0].used == 2
    # And --all-keys resets every key's window
    assert "reset scope 'exports': 2 window(s)" in _celery(prefix, "reset", "exports", "--all-keys", "--yes")
    assert not ctl.status("exports", key="acme").rates and not ctl.status("exports", key="globex").rates

