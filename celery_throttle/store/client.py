"""The Redis store: every family of operations (:mod:`.window`, :mod:`.controls`) over one
client (:mod:`.scripts`). Parked messages of earlier versions are kept by
:class:`.parking.ParkingStore`, over the same client."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.state import STATE_LAYOUT, StateLayout
from ..core.timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy
from .controls import ControlOps
from .window import WindowOps

__all__ = ["RedisStore"]


class RedisStore(WindowOps, ControlOps):
    """Window state and controls in one Redis (or Redis Cluster), and the client that
    :class:`.parking.ParkingStore` shares."""

    def __init__(self, url: str, prefix: str, clock: Callable[[], int] | None = None,
                 timeout: float = STORE_TIMEOUT, connect_timeout: float = STORE_CONNECT_TIMEOUT,
                 options: Mapping[str, Any] | None = None, policy: ScriptPolicy = SCRIPT_POLICY,
                 layout: StateLayout = STATE_LAYOUT) -> None:
        super().__init__(url, prefix, clock, timeout, connect_timeout, options, policy)
        #: The state layout the window scripts are loaded with (tests load them with others).
        self.layout = layout
        self.add_window_scripts(layout)
        self.add_control_scripts()
