"""Store URLs as text: which are Sentinel URLs, and a URL fit to log (its password masked)."""

from __future__ import annotations

from kombu.utils.url import maybe_sanitize_url

__all__ = ["SENTINEL_SCHEMES", "safe_url"]

SENTINEL_SCHEMES = ("sentinel://", "redis+sentinel://", "rediss+sentinel://")


def safe_url(url: str) -> str:
    """``url`` with any password masked, each part of a ``;``-separated list too."""
    return ";".join(maybe_sanitize_url(part) for part in url.split(";"))
