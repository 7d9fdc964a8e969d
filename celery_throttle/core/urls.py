"""Store URLs as text: which are Sentinel URLs, and a URL fit to log (its password masked)."""

from __future__ import annotations

from kombu.utils.url import maybe_sanitize_url

from .errors import ConfigurationError

__all__ = ["SENTINEL_SCHEMES", "STORE_SCHEMES", "check_store_url", "safe_url"]

SENTINEL_SCHEMES = ("sentinel://", "redis+sentinel://", "rediss+sentinel://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
#: The URLs a store may have: redis-py's own, a Redis Cluster's, a Sentinel group's.
STORE_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)


def check_store_url(url: str) -> None:
    """A ConfigurationError, at install, for a ``throttle_redis_url`` of no scheme a store
    has (else redis-py's ValueError would come at the first check, in a task)."""
    if not url.startswith(STORE_SCHEMES):
        raise ConfigurationError(f"throttle_redis_url {safe_url(url)!r}: use a redis://, rediss://, unix://, "
                                 "redis+cluster:// or Sentinel (sentinel://, redis+sentinel://) URL")


def safe_url(url: str) -> str:
    """``url`` with any password masked, each part of a ``;``-separated list too."""
    return ";".join(maybe_sanitize_url(part) for part in url.split(";"))
