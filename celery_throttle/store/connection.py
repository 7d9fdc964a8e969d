"""The redis-py client of the store, from ``throttle_redis_url`` and ``throttle_redis_options``.

- ``redis://``, ``rediss://`` (TLS), ``unix://``: redis-py's own URL parsing; AUTH and
  ACL users come in the URL or in the options.
- ``redis+cluster://`` / ``rediss+cluster://``: a Redis Cluster.
- ``sentinel://host:26379[;sentinel://host2:26379...]`` (as kombu and Celery write it)
  or ``redis+sentinel://``: the master of a Sentinel-watched group, through redis-py's
  Sentinel client, which finds the new master after a failover. The group is named by
  the ``master_name`` option (kombu's name) or by the URL's path,
  ``redis+sentinel://host:26379/mymaster/0``; a password in the URL is the master's,
  ``sentinel_kwargs`` in the options are for the Sentinels themselves.

Every other option (``ssl_ca_certs``, ``ssl_certfile``, ``username``,
``socket_keepalive``, ...) is passed to redis-py as it is; the store's own timeouts win
only where it needs them (the consumer's quick checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from kombu.utils.url import url_to_parts
from redis.sentinel import Sentinel

from ..core.errors import ConfigurationError
from ..core.urls import CLUSTER_SCHEMES, SENTINEL_SCHEMES, safe_url

__all__ = ["connect"]

#: Options that name the Sentinel group or talk to the Sentinels, not to Redis.
_SENTINEL_OPTIONS = ("master_name", "service_name", "sentinel_kwargs")


def connect(url: str, options: Mapping[str, Any] | None = None, **defaults: Any) -> Any:
    """A redis-py client for ``url``: ``options`` (the user's) over ``defaults``."""
    options = dict(options or {})
    if url.startswith(SENTINEL_SCHEMES):
        return _sentinel_master(url, options, defaults)
    for key in _SENTINEL_OPTIONS:
        options.pop(key, None)  # a broker's Sentinel options copied along: not ours here
    kwargs = {**defaults, **options}
    if url.startswith(CLUSTER_SCHEMES):
        return redis.RedisCluster.from_url(url.replace("+cluster", "", 1), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def _sentinel_master(url: str, options: dict[str, Any], defaults: Mapping[str, Any]) -> Any:
    sentinels: list[tuple[str, int]] = []
    password = username = None
    path = ""
    for part in filter(None, (p.strip() for p in url.split(";"))):
        _, host, port, user, secret, part_path, _ = url_to_parts(part)
        if not host:
            raise ConfigurationError(f"throttle_redis_url {safe_url(url)!r}: a Sentinel URL needs host:port")
        sentinels.append((host, int(port or 26379)))
        username, password = username or user, password or secret
        path = path or part_path or ""
    segments = [s for s in path.strip("/").split("/") if s]
    master = options.pop("master_name", None) or options.pop("service_name", None)
    if segments and not (segments[0].isascii() and segments[0].isdigit()):
        named = segments.pop(0)  # (the group's name in the path: the option's wins)
        master = master or named
    if not master:
        raise ConfigurationError(
            f"throttle_redis_url {safe_url(url)!r} is a Sentinel URL: name the master group, "
            "e.g. app.conf.throttle_redis_options = {'master_name': 'mymaster'} "
            "(or redis+sentinel://host:26379/mymaster/0)"
        )
    kwargs = {**defaults, **options}
    if segments and not (segments[0].isascii() and segments[0].isdigit()):
        raise ConfigurationError(f"throttle_redis_url {safe_url(url)!r}: after the master group's name, the path "
                                 f"holds the database number (e.g. /mymaster/0), not {segments[0]!r}")
    kwargs.setdefault("db", int(segments[0]) if segments else 0)
    if password and "password" not in options:
        kwargs["password"] = password
    if username and "username" not in options:
        kwargs["username"] = username
    if url.startswith("rediss+"):
        kwargs.setdefault("ssl", True)
    sentinel_kwargs = dict(kwargs.pop("sentinel_kwargs", None) or {})
    for timeout in ("socket_timeout", "socket_connect_timeout"):
        if timeout in defaults:
            sentinel_kwargs.setdefault(timeout, defaults[timeout])
    kwargs.pop("health_check_interval", None)  # (not for Sentinel-managed connections)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
    return sentinel.master_for(master)

