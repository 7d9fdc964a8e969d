"""The Python side and window.lua agree on the order of ARGV: each argument the builder
writes sits at the place the script's header documents for it."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis

from celery_throttle.errors import StoreError
from celery_throttle.protocol import (
    STATE_FORMAT,
    STATE_LAYOUT,
    Code,
    Reservation,
    WindowCall,
    rate_field,
    window_argv,
)
from celery_throttle.rates import Rate
from celery_throttle.store import RedisStore, window_script
from celery_throttle.timing import SCRIPT_POLICY
from tests.helpers import STORE_URL

#: Each documented ARGV slot, by the words its header line starts with.
DOCUMENTED = {
    1: "now in microseconds", 2: "op:", 3: "'1' to reserve", 4: "cost:", 5: "grace", 6: "slack",
    7: "for 'claim': the reservation's start", 13: "'1' if this claim is the task's arrival",
    14: "lease:", 15: "lease span", 16: "max wait", 17: "not before", 18: "pause horizon",
    19: "early (µs), for 'claim'", 20: "number of rates",
}


def _header() -> dict[int, str]:
    text = resources.files("celery_throttle").joinpath("lua", "window.lua").read_text("utf-8")
    return {int(m.group(1)): m.group(2).strip()
            for m in re.finditer(r"^-- ARGV\[(\d+)(?:\.\.\d+)?\]\s+(.*)$", text, re.MULTILINE)}


def test_every_argument_sits_where_window_lua_documents_it() -> None:
    header = _header()
    for slot, words in DOCUMENTED.items():
        assert header[slot].startswith(words), f"ARGV[{slot}] is documented as {header[slot]!r}"
    claim = Reservation(start_us=701, latest_us=702, cost=703, grace_us=704, epoch=705, lead_us=706)
    rates = (Rate(10, 1.0), Rate(500, 3600.0))
    call = WindowCall("sliding", rates, 104, grace_us=105, slack_us=106, max_wait_us=116, not_before_us=117,
                      pause_horizon_us=118)
    argv = window_argv("101", "claim", call, reserve=True, claim=claim, learn="0", lease=114, lease_span_us=115,
                       early_us=119)
    placed = {1: "101", 2: "claim", 3: "1", 4: 104, 5: 105, 6: 106, 7: 701, 8: 702, 9: 703, 10: 704,
              11: 705, 12: 706, 13: "0", 14: 114, 15: 115, 16: 116, 17: 117, 18: 118, 19: 119, 20: 2}
    assert {slot: argv[slot - 1] for slot in placed} == placed
    assert argv[20:] == [10, 1_000_000, rate_field("sliding", rates[0]), 500, 3_600_000_000,
                         rate_field("sliding", rates[1])]
    assert "then ARGV[21..]: limit, period (µs) and field name per rate" in header[20]


def test_reply_codes_match_the_script() -> None:
    text = resources.files("celery_throttle").joinpath("lua", "window.lua").read_text("utf-8")
    header = " ".join(text[text.index("-- Returns"):text.index("local key = KEYS[1]")].replace("--", "").split())
    for code, meaning in ((Code.RUN, "run now"), (Code.DENIED, "not now, and no start reserved"),
                          (Code.RESERVED, "not now, and a start was reserved"),
                          (Code.EARLY, "a claim that came before"), (Code.TOO_FAR, "denied, and the earliest start"),
                          (Code.TOO_COSTLY, "the cost exceeds the limit"),
                          (Code.RUN_AT, "a claim that came at most ARGV[19] before its reserved start")):
        assert f"{code.name} {meaning}" in header, f"code {code.name} is not documented as {meaning!r}"
    assert [c.value for c in (Code.RUN, Code.DENIED, Code.RESERVED, Code.EARLY, Code.TOO_FAR, Code.TOO_COSTLY,
                              Code.RUN_AT)] == [1, 0, 4, 2, 3, -1, 5]


#: The layout constants of the other algorithm: given to each script, read by one.
_OTHER_ALGORITHMS_LAYOUT = {"sliding": {"MAX_AHEAD", "KEEP_AHEAD"}, "fixed": {"SLOTS", "MAX_BUCKETS"}}


def test_the_scripts_read_every_constant_they_are_loaded_with_and_no_other() -> None:
    # The constants the window scripts are given: the timing policy, the state layout,
    # the reply codes and the state format, on a first line of their own
    for algorithm in ("sliding", "fixed"):
        script = window_script(algorithm)
        first = script.split("\n", 1)[0]
        given = dict(zip(first.removeprefix("local ").split(" = ")[0].split(", "),
                         first.split(" = ")[1].split(", "), strict=True))
        assert given == {**{k: str(v) for k, v in SCRIPT_POLICY.values().items()},
                         **{k: str(v) for k, v in STATE_LAYOUT.values().items()},
                         **{c.name: str(c.value) for c in Code}, "STATE_FORMAT": str(STATE_FORMAT)}
        # Each is used by the algorithm or window.lua, and they use no capitalised name
        # they are not given but those they set themselves (MAX_COLD_BYTES, ...)
        used: set[str] = set()
        own: set[str] = set()
        for name in (f"{algorithm}.lua", "window.lua"):
            text = resources.files("celery_throttle").joinpath("lua", name).read_text("utf-8")
            code = re.sub(r"'[^']*'", "", "\n".join(line.split("--")[0] for line in text.splitlines()))
            used |= set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", code)) - {"ARGV", "KEYS", "ALGO"}
            own |= set(re.findall(r"^local ([A-Z][A-Z_]{2,}) =", code, re.MULTILINE))
        assert own.isdisjoint(given), f"{algorithm}: sets a constant it is given: {own & set(given)}"
        assert used - own == set(given) - _OTHER_ALGORITHMS_LAYOUT[algorithm]


def test_an_error_in_a_script_names_the_file_and_its_own_line(store_client: redis.Redis, prefix: str) -> None:
    # Given a call whose ARGV says one rate but carries none (its field name missing)
    store = RedisStore(STORE_URL, prefix)
    window = resources.files("celery_throttle").joinpath("lua", "window.lua").read_text("utf-8").splitlines()
    try:
        argv = window_argv("", "peek", WindowCall("sliding", (Rate(1, 1.0),)))
        # When the script runs it
        with pytest.raises(StoreError) as failed:
            store.run("sliding", [f"{prefix}:k"], argv[:19] + ["1"])
        # Then the error names window.lua and its line there (the arithmetic on the rate's
        # missing period), not the line in the script as loaded
        named = re.search(r"window\.lua:(\d+): attempt to perform arithmetic on field 'period'", str(failed.value))
        assert named, str(failed.value)
        assert "r.period" in window[int(named.group(1)) - 1], (named.group(0), window[int(named.group(1)) - 1])
    finally:
        store.close()
