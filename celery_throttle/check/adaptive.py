"""This process's side of adaptive limits (:mod:`celery_throttle.core.adapt`): the lowering a
downstream's pushback makes, and the level a key is at, as people on call read it.

The level lives with the key's windows, in its state hash ('A': the last pushback), and
window.lua computes the limits in force from it at every check on the store's clock, so a
lowering holds on every worker from its next check on (a copy of it in each process, read
now and then, would let the others start half a window more at the old limit).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..core import timing
from ..core.adapt import Adapt, Pushback, level
from ..core.keys import target_of
from ..core.protocol import WindowCall, per_rate
from ..core.spec import BoundCall, ThrottleSpec
from ..core.state import rate_field
from ..core.timing import shortest_us

__all__ = ["Level", "gauge_levels", "level_of", "levels", "lower"]

#: Keys the gauges read the level of, at most (the most lately pushed back): a tenant per
#: key must not make one read of them grow without bound.
GAUGED_KEYS = 1000

logger = logging.getLogger("celery_throttle")


def law(adapt: Adapt) -> tuple[float, float, float]:
    """``adapt`` as the scripts are told it."""
    return adapt.floor, adapt.decrease, adapt.growth


def lower(store: Any, call: BoundCall, adapt: Adapt, reason: str = "backoff") -> bool:
    """The downstream of ``call`` pushed back: its key's level is lowered (once per window
    of its rates), never above the share of the ceiling its own starts fill in the window
    now. Returns whether this call lowered it (False: one within the window did)."""
    used, unit = used_share(store, call)
    before, after, lowered = store.lower(call.state_key, law(adapt), shortest_us(call.rates), reason, used, unit)
    if lowered:
        logger.info("celery_throttle: scope %r%s pushed back (%s): its limits go from %.0f%% to %.0f%% of the "
                    "declared, rising again as nothing pushes back", call.scope,
                    "" if call.key is None else f" key {call.key!r}", reason, 100 * before, 100 * after)
    return bool(lowered)


def used_share(store: Any, call: BoundCall) -> tuple[float, float]:
    """The share of its declared limit the fullest of ``call``'s rates holds now (each
    rate looked at alone, at its full limit), and the share of it one call is."""
    fields = call.fields or tuple(rate_field(call.algorithm, r) for r in call.rates)
    share, unit = 0.0, 0.0
    for rate, field, cost in zip(call.rates, fields, per_rate(call.cost, len(call.rates))):
        reply = store.peek(call.state_key, WindowCall(call.algorithm, (rate,), fields=(field,)))
        if (rate.limit - reply.remaining) / rate.limit >= share:
            share, unit = (rate.limit - reply.remaining) / rate.limit, cost / rate.limit
    return share, unit


class Level(NamedTuple):
    """Where an adaptive key stands: the share of its declared rates in force now, its
    last pushback (None: none lately), and how long ago that was (seconds)."""

    share: float
    pushback: Pushback | None
    ago: float


def level_of(adapt: Adapt, raw: bytes | str | None, now_us: int, window_us: int) -> Level:
    """The level of a key whose state hash holds ``raw`` in its field 'A', at ``now_us``."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        pushed = Pushback.read(text) if text else None
    except ValueError:
        pushed = None
    if pushed is None:
        return Level(1.0, None, 0.0)
    return Level(level(adapt, pushed, now_us, window_us), pushed, max(now_us - pushed.at_us, 0) / 1e6)


def levels(store: Any, specs: Sequence[tuple[str, ThrottleSpec]]) -> dict[tuple[str, str | None], tuple[float, float]]:
    """The level now and the floor of every adaptive key pushed back lately (at most
    GAUGED_KEYS): (scope, key) to (share, floor). A key whose level is back at its ceiling
    leaves the index."""
    adapts = {scope: spec.adapt for scope, spec in specs if spec.adapt is not None and isinstance(spec.rates, tuple)}
    windows = {scope: min(timing.widened_period_us(r.period_us, spec.margin) for r in spec.rates)
               for scope, spec in specs if scope in adapts and isinstance(spec.rates, tuple) and spec.rates}
    if not adapts:
        return {}
    pushed = store.pushed_back(GAUGED_KEYS)
    now_us, out, done = store.now_us(), {}, []
    for key, raw in pushed:
        target = target_of(store.prefix, key)
        if target is None or target[0] not in adapts:
            continue
        adapt = adapts[target[0]]
        at = level_of(adapt, raw, now_us, windows.get(target[0], 1_000_000))
        out[target] = (at.share, adapt.floor)
        if at.pushback is None or at.share >= 1.0:
            done.append(key)
    store.forget_pushed_back(done)
    return out


def gauge_levels(store: Any, specs: Sequence[tuple[str, ThrottleSpec]], metrics: Any) -> None:
    """Set the adaptive gauges: each key's level (labelled by key), or each scope's lowest."""
    found = levels(store, specs)
    if not metrics.with_keys:
        lowest: dict[tuple[str, str | None], tuple[float, float]] = {}
        for (scope, _), (share, floor) in found.items():
            seen = lowest.get((scope, None))
            lowest[(scope, None)] = (share, floor) if seen is None or share < seen[0] else seen
        found = lowest
    for (scope, key), (share, floor) in found.items():
        metrics.adaptive(scope, key, share, floor)
