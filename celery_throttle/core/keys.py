"""Redis key layout.

Every key starts with the configured prefix. The state of one (scope, key) lives in one
hash, ``<prefix>:{<scope>:<key>}``; the braces are a Redis Cluster hash tag, so all the
rates of one call are checked by one script on one slot. Scope and key are encoded so
that any string (``:``, braces, ``*``, spaces, unicode, 10 kB) maps to a distinct,
bounded, brace-free token.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import string
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import quote, unquote

from .errors import ConfigurationError, KeyBuildError

__all__ = [
    "LINE_SUFFIXES",
    "MAX_TOKEN",
    "adaptive_index_key",
    "control_key",
    "dead_letter_keys",
    "decode",
    "encode",
    "format_key",
    "glob_escape",
    "journal_keys",
    "line_index_key",
    "line_index_keys",
    "line_scan_patterns",
    "record_key",
    "scan_pattern",
    "scope_state_patterns",
    "shadow_key",
    "share_key",
    "share_lock_key",
    "share_registry_key",
    "share_wake_key",
    "state_key",
    "state_of",
    "state_tag",
    "sweep_key",
    "target_matches",
    "target_of",
    "template_fields",
    "wake_key",
    "window_keys",
]

# Characters kept as they are; everything else is percent-encoded (":" "{" "}" "%" "#"
# included), which makes the encoding injective and leaves ":" free as a separator.
_SAFE = string.ascii_letters + string.digits + "-_.@"
MAX_TOKEN = 120


#: Components this long at most are remembered once encoded: a tenant id of a megabyte is
#: encoded each time, not kept in every process.
CACHED_TEXT = 256


def encode(text: str) -> str:
    """Encode one component; long ones become ``#`` and a SHA-256 (``#`` never survives
    percent-encoding, so a digest cannot equal an encoded string)."""
    return _encode_cached(text) if len(text) <= CACHED_TEXT else _encode(text)


@lru_cache(maxsize=65536)
def _encode_cached(text: str) -> str:
    return _encode(text)


def _encode(text: str) -> str:
    # surrogatepass: a lone surrogate (json.loads('"\\ud800"') makes one) is still a key.
    raw = text.encode("utf-8", "surrogatepass")
    token = quote(raw, safe=_SAFE)
    if len(token) > MAX_TOKEN:
        token = "#" + hashlib.sha256(raw).hexdigest()
    return token


def decode(token: str) -> str:
    """The component :func:`encode` made ``token`` from; a digest (``#…``) stays as it is."""
    return token if token.startswith("#") else unquote(token, errors="surrogatepass")


def check_prefix(prefix: str) -> str:
    if not prefix or any(c in prefix for c in "{}") or prefix != prefix.strip():
        raise ConfigurationError(
            f"throttle_key_prefix {prefix!r} must be non-empty, without braces or surrounding spaces"
        )
    return prefix


def state_key(prefix: str, scope: str, key: str | None) -> str:
    """The hash holding every rate's window state for one scope and key."""
    return f"{prefix}:{{{state_tag(scope, key)}}}"


def state_tag(scope: str, key: str | None) -> str:
    """The token naming one scope and key (inside the braces of its state hash)."""
    return encode(scope) if key is None else f"{encode(scope)}:{encode(key)}"


def wake_key(prefix: str) -> str:
    """A list the releasers wait on (BLPOP) between rounds: a push wakes one at once (in
    the index's hash tag)."""
    return f"{prefix}:{{lines}}:wake"


def dead_letter_keys(prefix: str) -> tuple[str, str]:
    """The dead letters (tasks released from a line, or sent on by the journal, whose
    message could not be sent): their messages by id, and their ids by when, one hash tag."""
    return f"{prefix}:{{dead}}:messages", f"{prefix}:{{dead}}:at"


def scan_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every state hash and concurrency slots' set under
    ``prefix`` (and a few other keys that :func:`target_of` turns away)."""
    return f"{glob_escape(prefix)}:{{*"


#: The names of a state hash's companion keys that mean a scope and key exist: its slots'
#: holders, its line's counts (:func:`window_keys`) and its shadow state (:func:`shadow_key`).
_SLOT_SUFFIXES = (":slots", ":lm", ":shadow")


def target_of(prefix: str, redis_key: str) -> tuple[str, str | None] | None:
    """(scope, key) of a state hash, or of its slots' holders or queue; None for any
    other key."""
    for suffix in _SLOT_SUFFIXES:
        if redis_key.endswith("}" + suffix):
            return state_of(prefix, redis_key[: -len(suffix)])
    return state_of(prefix, redis_key)


def glob_escape(text: str) -> str:
    """``text`` as a Redis MATCH pattern that matches only itself."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def state_of(prefix: str, redis_key: str) -> tuple[str, str | None] | None:
    """(scope, key) of a state hash's name, or None for any other key."""
    head = f"{prefix}:{{"
    if not (redis_key.startswith(head) and redis_key.endswith("}")):
        return None
    tag = redis_key[len(head):-1]
    if not tag or any(c in tag for c in "{}"):
        return None
    scope, sep, key = tag.partition(":")
    return decode(scope), (decode(key) if sep else None)


def window_keys(state_key: str) -> tuple[str, str, str, str, str, str, str]:
    """Every key of one scope and key that window.lua works on, all in its hash tag: the
    state hash, the line's counts, the line, the messages waiting (and what each is), the
    tasks released and not started, the concurrency slots' holders, and the entries that
    started lately."""
    return (state_key, f"{state_key}:lm", f"{state_key}:line", f"{state_key}:msgs", f"{state_key}:out",
            f"{state_key}:slots", f"{state_key}:used")


def shadow_key(state_key: str) -> str:
    """The state of a scope and key in shadow mode: where enforcing would have started its
    calls (window.lua's keys of their own, :func:`window_keys` of this one, in the same
    hash tag; never a state hash to :func:`state_of`)."""
    return f"{state_key}:shadow"


def share_key(state_key: str) -> str:
    """A key's cap in its scope's share of slots (window.lua's KEYS[8]; waits/sharer.py)."""
    return f"{state_key}:share"


def share_registry_key(prefix: str, scope: str, tag: str = "#share") -> str:
    """The keys of ``scope`` that take part in its share, each to its weight and most: the
    part of hash tag ``tag`` (a single Redis has one, ``#share``: store/sharing.py). (The
    tag begins with ``#``, which no encoded scope does: never a scope's own key.)"""
    return f"{prefix}:{{{tag}}}:{encode(scope)}"


def share_lock_key(prefix: str, scope: str) -> str:
    """The lock of the worker that moves ``scope``'s caps (waits/sharer.py)."""
    return share_registry_key(prefix, scope) + "#lock"


def share_wake_key(prefix: str, scope: str) -> str:
    """The list ``scope``'s sharer waits on: a slot given back beyond its key's cap, a key
    that joins (waits/sharer.py)."""
    return share_registry_key(prefix, scope) + "#wake"


def line_index_key(prefix: str, tag: str = "lines") -> str:
    """The index of state keys with a line, by when each next needs a look (index.lua):
    the part of hash tag ``tag`` (a single Redis has one, ``lines``: store/index.py)."""
    return f"{prefix}:{{{tag}}}:due"


#: The companion keys of a state hash that mean it has a line: its counts and its entries
#: (a store evicting may take either).
LINE_SUFFIXES = (":lm", ":line")


def line_scan_patterns(prefix: str) -> tuple[tuple[str, str], ...]:
    """(SCAN MATCH pattern, suffix) for every key of :data:`LINE_SUFFIXES` under ``prefix``:
    a name that matches, less its suffix, is a state key with a line."""
    return tuple((f"{glob_escape(prefix)}:{{*}}{suffix}", suffix) for suffix in LINE_SUFFIXES)


def scope_state_patterns(prefix: str, scope: str, key: str | None = None) -> list[str]:
    """MATCH patterns for the state keys of ``scope`` (and only its ``key``, if given)."""
    if key is not None:
        return [glob_escape(state_key(prefix, scope, key))]
    head = glob_escape(f"{prefix}:{{{encode(scope)}")
    return [head + "}", head + ":*}"]


def sweep_key(prefix: str) -> str:
    """The lock of the worker that looks for lines missing from the index (one a round)."""
    return f"{prefix}:{{lines}}:sweep"


def adaptive_index_key(prefix: str) -> str:
    """The keys of adaptive throttles pushed back lately, by when (the gauges read them)."""
    return f"{prefix}:{{adaptive}}"


def journal_keys(prefix: str) -> tuple[str, str, str]:
    """The journal's keys in the store: the hash of its epoch (an id the store holds while
    it holds its lines) and of the keeper's last pass; the keeper's lock; the entries the
    keeper sent on (each once)."""
    return f"{prefix}:{{lines}}:journal", f"{prefix}:{{lines}}:keeper", f"{prefix}:{{lines}}:sent-on"


def line_index_keys(prefix: str, tag: str = "lines") -> tuple[str, str]:
    """index.lua's keys for the index's part of hash tag ``tag``: the part, and when each
    due time in it was computed."""
    return line_index_key(prefix, tag), f"{prefix}:{{{tag}}}:at"


def record_key(prefix: str) -> str:
    """The record of what the throttle saw (a stream; ``throttle_record``)."""
    return f"{prefix}:{{record}}:events"  # (not a state hash's name: it ends past its tag)


def control_key(prefix: str) -> str:
    """The hash of run-time controls (pauses), read by every worker."""
    return f"{prefix}:control"


def target_matches(scope: str, key: str | None, scope_glob: str = "*", key_glob: str | None = None) -> bool:
    """Whether a scope and key are selected by two globs, one per part: never one glob
    over ``scope:key``, which is ambiguous when a scope or key holds ``:``. Without
    ``key_glob`` any key (or none) is selected; with it, only keys it matches."""
    if not fnmatch.fnmatchcase(scope, scope_glob):
        return False
    return key_glob is None or (key is not None and fnmatch.fnmatchcase(key, key_glob))


def format_key(template: str, task_name: str, signature: inspect.Signature | None, args: Sequence[Any],
               kwargs: Mapping[str, Any]) -> str:
    """The key a template (``"{tenant_id}"``) names for one call of ``task_name``, whose
    arguments bind to ``signature`` (None: unknown, keyword arguments only); KeyBuildError
    when an argument it names is missing, None or empty."""
    if signature is None:
        # (A task this process does not have, sent by name under a rule: its keyword
        # arguments are all there is to go by.)
        if args:
            raise KeyBuildError(f"task {task_name}: cannot read its parameters to build key {template!r}")
        values = dict(kwargs)
    else:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KeyBuildError(f"task {task_name}: arguments do not fit its signature: {exc}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(name, {}))
    for name in template_fields(template):
        if name not in values:
            raise KeyBuildError(f"task {task_name}: key {template!r} needs argument {name!r}, not given")
        if values[name] is None or values[name] == "":
            raise KeyBuildError(
                f"task {task_name}: argument {name!r} is {values[name]!r}, "
                f"but the throttle key {template!r} needs a value"
            )
    try:
        return template.format(**values)
    except (AttributeError, IndexError, KeyError, ValueError) as exc:
        raise KeyBuildError(f"task {task_name}: cannot build key {template!r}: {exc!r}") from None


@lru_cache(maxsize=256)
def template_fields(template: str) -> tuple[str, ...]:
    """The arguments a key template names (ConfigurationError for a template that names
    none, or positions)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigurationError(f"bad key template {template!r}: {exc}") from None
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise ConfigurationError(
                f"key template {template!r} must name arguments, as in '{{tenant_id}}'"
            )
        names.append(base)
    return tuple(names)
