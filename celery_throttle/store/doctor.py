"""What the store risks: read at worker start (and by ``celery throttle doctor``), as
BullMQ and Sidekiq check their Redis.

Parked tasks and window counts live in the store. A store that may evict keys
(``maxmemory-policy`` other than ``noeviction``) can drop them under memory pressure,
and one that keeps nothing on disk loses them when it restarts. Each risk is one line
that says what can be lost and how to fix it. Where ``CONFIG`` is refused (managed
servers), ``INFO`` is read instead, and what it cannot tell is said once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

__all__ = ["StoreReport", "examine"]

#: Policies that evict only keys with a TTL: window states have one (counts can go),
#: the lines (the tasks waiting in them) do not.
_VOLATILE = ("volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl")


@dataclass(frozen=True)
class StoreReport:
    """What was found about one store."""

    #: The server's run id (it changes when the server restarts), or None.
    run_id: str | None
    #: One sentence per risk: what can be lost, and how to fix it.
    risks: tuple[str, ...]
    #: What could not be checked (CONFIG refused, an INFO field missing).
    unchecked: tuple[str, ...]
    #: The run id this store's connection saw at its report before, when it changed since
    #: (the server restarted: whatever it did not keep on disk may be lost); else None.
    restarted_from: str | None = None

    def summary(self) -> str:
        """For the worker's start line."""
        if not self.risks and not self.unchecked:
            return "no eviction, persistent"
        return "; ".join((*(f"RISK: {r}" for r in self.risks), *(f"not checked: {u}" for u in self.unchecked)))


def _one_node(reply: Any) -> Any:
    """A cluster client answers per node: the first node's answer (all share a config,
    as a cluster should)."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return next(iter(reply.values()))
    return reply


def _config(client: Any, name: str) -> str | None:
    try:
        value = _one_node(client.config_get(name)).get(name)
    except RedisError:
        return None  # CONFIG refused (managed servers rename or forbid it)
    return None if value is None else str(value)


def examine(client: Any, journaled: bool = False) -> StoreReport:
    """Read the store's eviction policy, persistence and run id (raises RedisError only
    if the server cannot be reached at all). ``journaled``: the tasks waiting in the lines
    have a copy in the broker's journal, and are not at risk."""
    info = _one_node(client.info())
    # (The tasks waiting in the lines are kept in the store whatever the broker; with the
    # journal on, a copy of each is in the broker too, and the keeper sends them on.)
    parked = "" if journaled else "the tasks waiting in the lines (they are lost), "
    risks: list[str] = []
    unchecked: list[str] = []
    policy = _config(client, "maxmemory-policy") or info.get("maxmemory_policy")
    if policy is None:
        unchecked.append("the eviction policy (neither CONFIG nor INFO gave maxmemory-policy)")
    elif policy in _VOLATILE:
        risks.append(f"maxmemory-policy is {policy}: under memory pressure Redis may evict window counts "
                     "(a limit forgets what it counted); set maxmemory-policy noeviction on the store")
    elif policy != "noeviction":
        risks.append(f"maxmemory-policy is {policy}: under memory pressure Redis may evict {parked}window "
                     f"counts and pauses; set maxmemory-policy noeviction on the store, or give the "
                     "throttle a Redis of its own that does not evict")
    save, appendonly = _config(client, "save"), _config(client, "appendonly")
    aof = appendonly == "yes" if appendonly is not None else bool(info.get("aof_enabled"))
    if save is None and appendonly is None:
        if not aof:
            unchecked.append("RDB snapshots (CONFIG refused; INFO shows no AOF): if the store keeps nothing "
                             f"on disk, a restart loses {parked}counts and pauses")
    elif not aof and not (save or "").strip():
        risks.append("the store keeps nothing on disk (save \"\", appendonly no): a restart empties it and "
                     f"loses {parked}counts and pauses; turn on appendonly yes (or RDB snapshots)"
                     + ("; the tasks waiting in the lines are sent on from the journal in the broker" if journaled
                        else ""))
    return StoreReport(info.get("run_id"), tuple(risks), tuple(unchecked))
