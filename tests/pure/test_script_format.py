"""The Python side and window.lua agree on the order of ARGV: each argument the builder
writes sits at the place the script's header documents for it."""

from __future__ import annotations

import re

import pytest
import redis

from celery_throttle.core.errors import StoreError
from celery_throttle.core.protocol import (
    REPLY_PLACES,
    Code,
    Entry,
    Verdict,
    WindowCall,
    WindowReply,
    window_argv,
)
from celery_throttle.core.rates import Rate
from celery_throttle.core.state import FOREVER_US, STATE_FORMAT, STATE_LAYOUT, rate_field
from celery_throttle.core.timing import SCRIPT_POLICY
from celery_throttle.store.client import RedisStore
from celery_throttle.store.compose import lua, pruned, script_parts
from celery_throttle.store.index import WAKE_TTL_MS
from celery_throttle.store.window import OPERATIONS, window_constants, window_script
from tests.helpers import STORE_URL

#: Each documented ARGV slot of window.lua's head, by the words its header line starts with.
DOCUMENTED = {
    1: "now in microseconds", 2: "op (its script's name: lua/op/ has them)", 3: "cost:", 4: "slack", 5: "not before",
    6: "concurrency", 7: "a running body's slot lease", 8: "lead", 9: "controls read at", 10: "number of rates",
}


def _header(name: str = "window.lua") -> dict[int, str]:
    text = lua(name)
    return {int(m.group(1)): m.group(2).strip()
            for m in re.finditer(r"^-- ARGV\[(\d+)(?:\.\.\d+)?\]\s+(.*)$", text, re.MULTILINE)}


def test_every_argument_sits_where_window_lua_documents_it() -> None:
    header = _header()
    for slot, words in DOCUMENTED.items():
        assert header[slot].startswith(words), f"ARGV[{slot}] is documented as {header[slot]!r}"
    rates = (Rate(10, 1.0), Rate(500, 3600.0))
    call = WindowCall("sliding", rates, 104, slack_us=105, not_before_us=106, concurrency=107, slot_lease_us=108,
                      lead_us=109, read_us=110)
    entry = Entry("e", b"m", "t", 4, 5, 6, "n", -3)
    argv = window_argv("101", "acquire", call, 11, 12, "h", *entry.args())
    assert argv[:10] == ["101", "acquire", 104, 105, 106, 107, 108, 109, 110, 2]
    assert argv[10:16] == [10, 1_000_000, rate_field("sliding", rates[0]), 500, 3_600_000_000,
                          rate_field("sliding", rates[1])]
    # the operation's own, from P = 11 + 3 * rates: acquire's lease, span, holder, then the entry's
    assert argv[16:] == [11, 12, "h", "e", b"m", "t", 4, 5, 6, "n", -3]
    assert "then ARGV[11..]: limit, period (µs) and field name per rate" in header[10]


def test_each_operations_arguments_are_where_its_file_documents_them() -> None:
    text = "\n".join(lua(name) for name in ("line.lua", *(f"op/{f}.lua" for f in sorted(set(OPERATIONS.values())))))
    documented = " ".join(" ".join(line.removeprefix("--").strip() for line in text.splitlines()
                                   if line.startswith("--")).split())
    for words in ("acquire: a fresh call", "[P] lease, [P+1] lease span, [P+2] holder (a delivery id), then the entry's",
                  "claim: a released task arrives", "[P] ticket, [P+1] how early it may come at most",
                  "[P+2] holder", "[P+3] the start granted to this process earlier",
                  "release: release the heads that fit. [P] batch", "ack: the tasks released were sent",
                  "settle: a call that started reports its real cost", "[P] at, [P+1] latest, [P+2] epoch",
                  "The entry's arguments: [E] entry id, [E+1] message ('' none), [E+2] task id, [E+3] expires",
                  "[E+5] batch, [E+6] the nonce of the holder of this task's own call whose reply was lost",
                  "[E+7] its urgency", "[P+12] '1' if it may be told STALE"):
        assert " ".join(words.split()) in documented, f"nothing documents {words!r}"


def test_reply_codes_match_the_script() -> None:
    text = lua("line.lua")
    header = " ".join(" ".join(line.removeprefix("--").strip() for line in text.splitlines()
                               if line.startswith("--")).split())
    assert "Codes (protocol.Code): RUN, RUN_AT, DENIED, QUEUED, RELEASED, TOO_FAR, TOO_COSTLY, WAITED, LOST" in header
    assert "DUPLICATE (a copy of a task" in header and "STALE (claim)" in header
    assert {c.name for c in Code} == {"RUN", "RUN_AT", "DENIED", "QUEUED", "RELEASED", "TOO_FAR", "TOO_COSTLY",
                                      "WAITED", "LOST", "DUPLICATE", "STALE"}


def test_every_reply_code_has_one_verdict_and_every_verdict_a_code() -> None:
    # The hook, the screen and publish act on the verdict alone: a code without one would
    # be a KeyError in all three; a verdict no code gives would be a branch never taken.
    verdicts = {code: WindowReply(code, 0, 0, 0, 0, 0).verdict for code in Code}
    assert set(verdicts.values()) == set(Verdict)
    assert verdicts[Code.RUN] is Verdict.START and verdicts[Code.QUEUED] is Verdict.WAITS
    assert {c for c, v in verdicts.items() if v is Verdict.REFUSED} == {Code.TOO_FAR, Code.WAITED, Code.TOO_COSTLY}
    assert WindowReply(int(Code.RUN_AT), 0, 0, 0, 0, 0).verdict is Verdict.START_AT  # (the script's int)


#: The layout constants of the other algorithm: given to each script, read by one.
_OTHER_ALGORITHMS_LAYOUT = {"sliding": {"MAX_AHEAD", "KEEP_AHEAD"}, "fixed": {"BUCKETS", "MAX_BUCKETS"}}


def test_the_scripts_read_every_constant_they_are_loaded_with_and_no_other() -> None:
    # The constants the window scripts are given: the timing policy, the state layout,
    # the reply codes, the state format and how long a releasers' wake-up lasts
    given = window_constants()
    assert given == {**SCRIPT_POLICY.values(), **STATE_LAYOUT.values(), **{c.name: c.value for c in Code},
                     **REPLY_PLACES, "STATE_FORMAT": STATE_FORMAT, "FOREVER_US": FOREVER_US,
                     "WAKE_TTL_MS": WAKE_TTL_MS}
    assert REPLY_PLACES["REPLY_CODE"] == 1 and REPLY_PLACES["REPLY_SLOT_CAP"] == len(WindowReply._fields) - 1
    for algorithm in ("sliding", "fixed"):
        # Each is used by the algorithm, window.lua, line.lua or an operation, and they use
        # no capitalised name they are not given but those they set themselves
        used: set[str] = set()
        own: set[str] = set()
        files = (f"{algorithm}.lua", "window.lua", "line.lua", *(f"op/{f}.lua" for f in set(OPERATIONS.values())))
        for name in files:
            code = _code(lua(name))
            used |= set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", code)) - {"ARGV", "KEYS", "ALGO"}
            own |= set(re.findall(r"^local ([A-Z][A-Z_]{2,}) =", code, re.MULTILINE))
        assert own.isdisjoint(given), f"{algorithm}: sets a constant it is given: {own & set(given)}"
        assert used - own == set(given) - _OTHER_ALGORITHMS_LAYOUT[algorithm]
        # And in each operation's script as loaded, every one is written as its value
        for op in OPERATIONS:
            left = set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", _code(window_script(algorithm, op)))) & set(given)
            assert not left, f"{algorithm}/{op}: {left}"


def _code(text: str) -> str:
    """The code of a script: no comment, no string, no entry's field (M's)."""
    code = re.sub(r"'[^']*'", "", "\n".join(line.split("--")[0] for line in text.splitlines()))
    return re.sub(r"\bM\.[A-Z_]+|local M = \{[^}]*\}", "", code)


def test_each_operation_makes_only_the_functions_it_reaches() -> None:
    # A fresh call's script has the line's helpers a fresh call uses, and none of another
    # operation's own; the composed lines stay where their files have them
    acquire = window_script("sliding", "acquire")
    assert "local function fresh(" in acquire and "local function acquire(" in acquire
    for other in ("local function settle(", "local function renew(", "local function shadow(",
                  "local function per_rate("):
        assert other not in acquire
    composed = "".join(source for _, source in script_parts("sliding.lua", "window.lua", "line.lua", "op/acquire.lua"))
    assert acquire.count("\n") == composed.count("\n")
    # (A function on one line is a span of its own: pruned, it takes no line after it.)
    one_line = pruned("local function unused() return 1 end\nlocal x = 2\nend_of = x\nreturn x\n")
    assert one_line.split("\n")[:4] == ["", "local x = 2", "end_of = x", "return x"]
    # (and one whose first line closes an `if` of its own goes on to its `end`)
    two_lines = pruned("local function unused(x) if x then return end\n  return 1\nend\nreturn 2\n")
    assert two_lines.split("\n")[:4] == ["", "", "", "return 2"]
    settle = window_script("sliding", "settle")
    assert "local function per_rate(" in settle and "local function fresh(" not in settle


@pytest.mark.script
def test_a_window_script_is_made_on_its_first_run(store_client: redis.Redis, prefix: str) -> None:
    # Given a store just made: no operation's script composed yet (a process runs a few)
    store = RedisStore(STORE_URL, prefix)
    try:
        assert not [name for name in store._sources if "/" in name]
        # When a peek runs, then its script is made and registered, and no other
        store.peek(f"{prefix}:k", WindowCall("sliding", (Rate(1, 1.0),)))
        assert [name for name in store._sources if "/" in name] == ["sliding/peek"]
    finally:
        store.close()
        for key in store_client.scan_iter(match=f"{prefix}*"):
            store_client.delete(key)


@pytest.mark.script
def test_an_error_in_a_script_names_the_file_and_its_own_line(store_client: redis.Redis, prefix: str) -> None:
    # Given a call whose ARGV says one rate but carries none (its field name missing)
    store = RedisStore(STORE_URL, prefix)
    window = lua("window.lua").splitlines()
    try:
        argv = window_argv("", "peek", WindowCall("sliding", (Rate(1, 1.0),)))
        # When the script runs it
        with pytest.raises(StoreError) as failed:
            store.run("sliding/peek", [f"{prefix}:k{i}" for i in range(6)], argv[:9] + ["1"])
        # Then the error names window.lua and its line there (the unit read from the rate's
        # missing field name), not the line in the script as loaded
        named = re.search(r"window\.lua:(\d+): bad argument #1 to 'match'", str(failed.value))
        assert named, str(failed.value)
        assert "string.match(field" in window[int(named.group(1)) - 1], (named.group(0),
                                                                       window[int(named.group(1)) - 1])
    finally:
        store.close()
