"""Store URLs as text: which are Sentinel URLs, and a URL fit to show (its secrets masked)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .errors import ConfigurationError

__all__ = ["MASK", "SENTINEL_SCHEMES", "STORE_SCHEMES", "check_store_url", "safe_url", "scrub", "secrets_of"]

SENTINEL_SCHEMES = ("sentinel://", "redis+sentinel://", "rediss+sentinel://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
#: The URLs a store may have: redis-py's own, a Redis Cluster's, a Sentinel group's.
STORE_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)

#: What a masked secret reads as (kombu's mask, as Celery's own logs show a broker URL).
MASK = "**"
#: Query parameters that hold a secret: redis-py passes every parameter of the query to
#: its connection (``redis://host/0?password=...``).
_SECRET_PARAMETER = re.compile("pass|secret|token|credential|auth", re.IGNORECASE)
#: A secret as a client's repr writes it (redis-py 6.2 to 7.2 wrote a connection pool's
#: every argument, ``password=...`` too, and a Sentinel's error names its client).
_SECRET_IN_REPR = re.compile(r"\b(\w*(?:pass|secret|token|credential)\w*)=([^,)>\s]*)", re.IGNORECASE)


def check_store_url(url: str) -> None:
    """A ConfigurationError, at install, for a ``throttle_redis_url`` of no scheme a store
    has (else redis-py's ValueError would come at the first check, in a task)."""
    if not url.startswith(STORE_SCHEMES):
        raise ConfigurationError(f"throttle_redis_url {safe_url(url)!r}: use a redis://, rediss://, unix://, "
                                 "redis+cluster:// or Sentinel (sentinel://, redis+sentinel://) URL")


def safe_url(url: str) -> str:
    """``url`` with its secrets masked: the password of each part of a ``;``-separated list
    (a Sentinel URL's), and any query parameter that names one (``?password=``)."""
    return ";".join(_safe_part(part.strip()) for part in url.split(";"))


def _safe_part(url: str) -> str:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # (e.g. an unclosed "[" of an IPv6 host): show nothing past the scheme
        scheme = url.split("://", 1)[0] if "://" in url else ""
        return f"{scheme}://{MASK}" if scheme.isascii() and scheme.replace("+", "").isalnum() else MASK
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    secret_query = any(_SECRET_PARAMETER.search(name) for name, _ in pairs)
    if not password and not secret_query:
        return url
    netloc = parts.netloc
    if password:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}"
    query = parts.query
    if secret_query:
        query = "&".join(f"{quote(name)}={MASK if _SECRET_PARAMETER.search(name) else quote(value)}"
                         for name, value in pairs)
    # (by hand, not urlunsplit: that writes unix:///path as unix:/path)
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def secrets_of(url: str | None, options: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The secrets a store's URL and options hold: each part's password (as written and
    decoded), a secret query parameter's value, and in the options (``sentinel_kwargs``
    too) the string value of every key that names one (``password``, ``ssl_password``)."""
    found: set[str] = set()
    for part in (url or "").split(";"):
        try:
            split = urlsplit(part.strip())
            password = split.password
        except ValueError:
            continue
        if password:
            found.update((password, unquote(password)))
        found.update(value for name, value in parse_qsl(split.query) if _SECRET_PARAMETER.search(name))

    def walk(mapping: Mapping[Any, Any]) -> None:
        for name, value in mapping.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, (str, bytes)) and _SECRET_PARAMETER.search(str(name)):
                found.add(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)

    walk(options or {})
    return frozenset(found - {""})


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (an error's) with each of ``secrets``, and any ``password=...`` a client's
    repr wrote into it, masked; the longest first, so that no part of one is left."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _SECRET_IN_REPR.sub(lambda m: f"{m[1]}={MASK}", text)
