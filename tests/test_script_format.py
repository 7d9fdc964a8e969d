"""The Python side and window.lua agree on the order of ARGV: each argument the builder
writes sits at the place the script's header documents for it."""

from __future__ import annotations

import re
from importlib import resources

from celery_throttle.protocol import STATE_FORMAT, Code, Reservation, WindowCall, rate_field, window_argv
from celery_throttle.rates import Rate
from celery_throttle.store import window_script
from celery_throttle.timing import SCRIPT_POLICY

#: Each documented ARGV slot, by the words its header line starts with.
DOCUMENTED = {
    1: "now in microseconds", 2: "op:", 3: "'1' to reserve", 4: "cost:", 5: "grace", 6: "slack",
    7: "for 'claim': the reservation's start", 13: "'1' if this claim is the task's arrival",
    14: "lease:", 15: "lease span", 16: "max wait", 17: "not before", 18: "pause horizon",
    19: "number of rates",
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
    argv = window_argv("101", "claim", call, reserve=True, claim=claim, learn="0", lease=114, lease_span_us=115)
    placed = {1: "101", 2: "claim", 3: "1", 4: 104, 5: 105, 6: 106, 7: 701, 8: 702, 9: 703, 10: 704,
              11: 705, 12: 706, 13: "0", 14: 114, 15: 115, 16: 116, 17: 117, 18: 118, 19: 2}
    assert {slot: argv[slot - 1] for slot in placed} == placed
    assert argv[19:] == [10, 1_000_000, rate_field("sliding", rates[0]), 500, 3_600_000_000,
                         rate_field("sliding", rates[1])]
    assert "then ARGV[20..]: limit, period (µs) and field name per rate" in header[19]


def test_reply_codes_match_the_script() -> None:
    text = resources.files("celery_throttle").joinpath("lua", "window.lua").read_text("utf-8")
    header = " ".join(text[text.index("-- Returns"):text.index("local key = KEYS[1]")].replace("--", "").split())
    for code, meaning in ((Code.RUN, "run now"), (Code.DENIED, "not now, and no start reserved"),
                          (Code.RESERVED, "not now, and a start was reserved"),
                          (Code.EARLY, "a claim that came before"), (Code.TOO_FAR, "denied, and the earliest start"),
                          (Code.TOO_COSTLY, "the cost exceeds the limit")):
        assert f"{code.name} {meaning}" in header, f"code {code.name} is not documented as {meaning!r}"
    assert [c.value for c in (Code.RUN, Code.DENIED, Code.RESERVED, Code.EARLY, Code.TOO_FAR, Code.TOO_COSTLY)] == \
        [1, 0, 4, 2, 3, -1]


def test_the_script_reads_every_constant_it_is_loaded_with_and_no_other() -> None:
    # The constants window.lua is given: the timing policy, the reply codes and the state
    # format, on its first line (so its own line numbers shift by one)
    script = window_script("sliding")
    first = script.split("\n", 1)[0]
    given = dict(zip(first.removeprefix("local ").split(" = ")[0].split(", "),
                     first.split(" = ")[1].split(", "), strict=True))
    assert given == {**{k: str(v) for k, v in SCRIPT_POLICY.values().items()},
                     **{c.name: str(c.value) for c in Code}, "STATE_FORMAT": str(STATE_FORMAT)}
    # Each is used by the script, and the script uses no capitalised name it is not given
    # (but its algorithm's own: SLOTS, MAX_BUCKETS, ...)
    window = resources.files("celery_throttle").joinpath("lua", "window.lua").read_text("utf-8")
    code = re.sub(r"'[^']*'", "", "\n".join(line.split("--")[0] for line in window.splitlines()))
    used = set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", code)) - {"ARGV", "KEYS", "ALGO"}
    assert used == set(given)
