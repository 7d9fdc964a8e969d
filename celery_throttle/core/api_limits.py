"""What an API says of its own window, read from a reply's headers (pure).

Many APIs send their count on every reply: how many requests (and tokens) are left in the
window they enforce. A client that reads only its own count cannot see the calls the API
counted that it did not (another client on the same account, a retry it never saw, a
call that cost more tokens than its estimate); one that reads the API's can. The header
families read, each name case-insensitive:

- ``x-ratelimit-remaining-requests`` / ``-tokens`` (OpenAI and its imitators);
- ``anthropic-ratelimit-requests-remaining``, ``-tokens-``, ``-input-tokens-``,
  ``-output-tokens-remaining`` (Anthropic);
- ``x-ratelimit-remaining`` (GitHub, Discord and many more), ``x-rate-limit-remaining``
  (X), ``ratelimit-remaining`` (the IETF draft's first fields): requests;
- ``RateLimit`` as the IETF draft writes it now (``"default";r=50;t=30``: the remaining
  quota ``r`` of each policy) or as its earlier versions did (``limit=100, remaining=50,
  reset=30``): requests.

:func:`remaining` answers the least each unit has left, by the unit names rates use
(``""`` for requests: a rate of calls; ``tokens``, ``input_tokens``, ``output_tokens``).

:func:`exhausted` answers, by unit, the seconds until the API takes a call again where a
count says nothing is left, from the reset beside it:
``x-ratelimit-reset-requests``/``-tokens`` (OpenAI: a duration, ``1s``, ``6m0s``, ``20ms``),
``anthropic-ratelimit-*-reset`` (an RFC 3339 time), ``x-ratelimit-reset`` and
``x-rate-limit-reset`` (GitHub, X, Discord: a Unix time; a number below 10^9 is read as
seconds from now, as Reddit and others send it), ``x-ratelimit-reset-after`` (Discord:
seconds), ``ratelimit-reset`` (the IETF draft's first fields: seconds) and the ``t=`` of
the IETF ``RateLimit`` field (seconds).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

__all__ = ["MOST_RESET", "exhausted", "remaining", "resets"]

#: Header -> the unit its number counts ("" : requests, as a rate of calls counts them).
_FIELDS = {
    "x-ratelimit-remaining-requests": "",
    "x-ratelimit-remaining-tokens": "tokens",
    "anthropic-ratelimit-requests-remaining": "",
    "anthropic-ratelimit-tokens-remaining": "tokens",
    "anthropic-ratelimit-input-tokens-remaining": "input_tokens",
    "anthropic-ratelimit-output-tokens-remaining": "output_tokens",
    "x-ratelimit-remaining": "",
    "x-rate-limit-remaining": "",
    "ratelimit-remaining": "",
}
#: The longest header value read (a reply's headers are the API's, or a proxy's: bounded).
_MOST_CHARS = 1000
_INT = re.compile(r"\s*(\d{1,18})(?:\.\d*)?\s*$")
#: ``r=50`` in the IETF draft's RateLimit field, ``remaining=50`` in its earlier versions.
_REMAINING = re.compile(r"(?:^|[;,\s])(?:r|remaining)\s*=\s*(\d{1,18})(?!\d)")


#: Count header -> the headers that say when its window resets, and how: "duration"
#: (OpenAI's 1m30.5s), "time" (an RFC 3339 time), "unix" (a Unix time, or seconds from now
#: below UNIX_FROM), "seconds".
_RESETS_OF = {
    "x-ratelimit-remaining-requests": (("x-ratelimit-reset-requests", "duration"),),
    "x-ratelimit-remaining-tokens": (("x-ratelimit-reset-tokens", "duration"),),
    "anthropic-ratelimit-requests-remaining": (("anthropic-ratelimit-requests-reset", "time"),),
    "anthropic-ratelimit-tokens-remaining": (("anthropic-ratelimit-tokens-reset", "time"),),
    "anthropic-ratelimit-input-tokens-remaining": (("anthropic-ratelimit-input-tokens-reset", "time"),),
    "anthropic-ratelimit-output-tokens-remaining": (("anthropic-ratelimit-output-tokens-reset", "time"),),
    "x-ratelimit-remaining": (("x-ratelimit-reset", "unix"), ("x-ratelimit-reset-after", "seconds")),
    "x-rate-limit-remaining": (("x-rate-limit-reset", "unix"),),
    "ratelimit-remaining": (("ratelimit-reset", "seconds"),),
}
#: A reset further than this (seconds) is not believed: a day, the longest window APIs keep.
MOST_RESET = 86_400.0
#: A number of seconds this large is a Unix time (2001 on), not a delay.
UNIX_FROM = 1_000_000_000
_NUMBER = re.compile(r"\s*(\d{1,18}(?:\.\d{1,9})?)\s*$")
_DURATION = re.compile(r"\s*((?:\d{1,9}(?:\.\d{1,9})?(?:h|ms|m|s|us|µs|ns)){1,6})\s*$")
_DURATION_PART = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)(h|ms|m|s|us|µs|ns)")
_SCALE = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
#: ``t=30`` in the IETF draft's RateLimit field (seconds until its quota resets), ``reset=30``
#: in its earlier versions.
_RESET_IN = re.compile(r"(?:^|[;,\s])(?:t|reset)\s*=\s*(\d{1,18})(?!\d)")


def _fields(headers: Any) -> Iterator[tuple[str, str]]:
    """(name in lower case, value) of each header that is text, values bounded."""
    items = headers.items() if isinstance(headers, Mapping) or hasattr(headers, "items") else ()
    for name, value in items:
        if not isinstance(name, (str, bytes)) or not isinstance(value, (str, bytes, int)):
            continue
        name = (name.decode("latin-1") if isinstance(name, bytes) else name).strip().lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        yield name, text[:_MOST_CHARS]


def remaining(headers: Any) -> dict[str, int]:
    """The least each unit has left in the API's window, as ``headers`` (a mapping, or
    anything with ``items()``) say; units they say nothing of are absent. Values that do
    not read as whole numbers are ignored, never guessed."""
    found: dict[str, int] = {}

    def note(unit: str, value: int) -> None:
        found[unit] = min(value, found.get(unit, value))

    for name, text in _fields(headers):
        unit = _FIELDS.get(name)
        if unit is not None:
            matched = _INT.match(text)
            if matched:
                note(unit, int(matched.group(1)))
        elif name == "ratelimit":
            for matched in _REMAINING.finditer(text):
                note("", int(matched.group(1)))
    return found


def resets(headers: Any, now: float | None = None) -> dict[str, tuple[int, float]]:
    """By unit, what the API has left and the seconds from ``now`` (Unix time; default: the
    clock) until its window resets, where ``headers`` say both: each reset read beside its
    own count (an IETF ``RateLimit`` field's policy by policy); of several, the least left
    (and of those, the latest reset). A reset past is 0; one that does not read, or lies
    beyond MOST_RESET, is ignored."""
    now = time.time() if now is None else now
    fields = dict(_fields(headers))
    found: dict[str, tuple[int, float]] = {}

    def note(unit: str, left: int, seconds: float | None) -> None:
        if seconds is not None and seconds <= MOST_RESET:
            found[unit] = min(found.get(unit, (left, 0.0)), (left, max(seconds, 0.0)),
                              key=lambda pair: (pair[0], -pair[1]))

    for count, unit in _FIELDS.items():
        matched = _INT.match(fields.get(count, ""))
        if matched:
            for reset, form in _RESETS_OF[count]:
                if reset in fields:
                    note(unit, int(matched.group(1)), _reset_of(fields[reset], form, now))
    field = fields.get("ratelimit", "")
    # (now: a policy per comma, its parameters after ';'; earlier: one, its parameters by comma)
    for policy in field.split(",") if ";" in field else [field]:
        has, at = _REMAINING.search(policy), _RESET_IN.search(policy)
        if has and at:
            note("", int(has.group(1)), float(at.group(1)))
    return found


def exhausted(headers: Any, now: float | None = None) -> dict[str, float]:
    """By unit, the seconds from ``now`` until the API takes a call again, where ``headers``
    say it has nothing left of that unit (:func:`resets` with a count of 0)."""
    return {unit: seconds for unit, (left, seconds) in resets(headers, now).items() if not left}


def _reset_of(text: str, form: str, now: float) -> float | None:
    """Seconds from ``now`` that one reset header's ``text`` says, in its ``form``."""
    if form == "duration":
        matched = _DURATION.match(text)
        if matched is None:
            number = _NUMBER.match(text)  # (a bare number: seconds)
            return float(number.group(1)) if number else None
        return sum(float(n) * _SCALE[u] for n, u in _DURATION_PART.findall(matched.group(1)))
    if form == "time":
        try:
            at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            return None
        return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp() - now
    number = _NUMBER.match(text)
    if number is None:
        return None
    value = float(number.group(1))
    return value - now if form == "unix" and value >= UNIX_FROM else value
