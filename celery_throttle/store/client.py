"""The Redis store: every family of operations (:mod:`.window`, :mod:`.index`, :mod:`.lines`,
:mod:`.controls`, :mod:`.sharing`, :mod:`.keeper`, :mod:`.recording`, :mod:`.dead_letters`)
over one client (:mod:`.scripts`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.state import STATE_LAYOUT, StateLayout
from ..core.timing import SCRIPT_POLICY, STORE_CONNECT_TIMEOUT, STORE_TIMEOUT, ScriptPolicy
from .controls import ControlOps
from .dead_letters import DeadLetterOps
from .keeper import KeeperOps
from .lines import LineOps
from .recording import RecordOps
from .sharing import ShareOps
from .window import WindowOps

__all__ = ["RedisStore"]


class RedisStore(WindowOps, LineOps, ControlOps, ShareOps, KeeperOps, RecordOps, DeadLetterOps):
    """Window state, lines, controls, shares, the keeper's notes, the record and the dead
    letters in one Redis (or Redis Cluster): the only part of the plugin that speaks Redis."""

    def __init__(self, url: str, prefix: str, clock: Callable[[], int] | None = None,
                 timeout: float = STORE_TIMEOUT, connect_timeout: float = STORE_CONNECT_TIMEOUT,
                 options: Mapping[str, Any] | None = None, policy: ScriptPolicy = SCRIPT_POLICY,
                 layout: StateLayout = STATE_LAYOUT, index_parts: int | None = None) -> None:
        super().__init__(url, prefix, clock, timeout, connect_timeout, options, policy)
        #: The state layout the window scripts are loaded with (tests load them with others).
        self.layout = layout
        self.add_window_scripts(layout)
        # (index_parts: the index's parts whatever the URL says; tests split it on one Redis)
        self.add_index_scripts(index_parts)
        self.add_control_scripts()
        self.add_keeper_scripts()

    @classmethod
    def opened(cls, url: str, prefix: str, options: Mapping[str, Any], quick_timeout: float | None = None,
               clock: Callable[[], int] | None = None) -> RedisStore:
        """A store of ``url`` with ``throttle_redis_options``; ``quick_timeout``: one that
        gives up after it (the consumer's screen and the check at publish)."""
        options = dict(options)
        timeout, connect_timeout = STORE_TIMEOUT, STORE_CONNECT_TIMEOUT
        if quick_timeout is not None:
            # The quick store's timeouts are the point of it, whatever the options say.
            options.pop("socket_timeout", None)
            options.pop("socket_connect_timeout", None)
            timeout = connect_timeout = quick_timeout
        return cls(url, prefix, clock=clock, timeout=timeout, connect_timeout=connect_timeout, options=options)
