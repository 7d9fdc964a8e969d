"""Settings, read the Celery way: lowercase ``throttle_*`` keys in ``app.conf``."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigurationError
from .keys import check_prefix
from .urls import SENTINEL_SCHEMES, check_store_url, safe_url

logger = logging.getLogger("celery_throttle")

__all__ = ["ALGORITHMS", "STORE_ERROR_POLICIES", "Settings", "check_margin", "check_max_wait", "hide_secrets",
           "require_redis_url"]

ALGORITHMS = ("sliding", "fixed")
STORE_ERROR_POLICIES = ("defer", "allow", "fail")
#: What a throttle does: hold back what does not fit, or (``"shadow"``) count and report
#: what it would have held back, and hold nothing.
MODES = ("enforce", "shadow")
_DEFAULT_REDIS = "redis://localhost:6379/0"


@dataclass(frozen=True)
class Settings:
    """Every ``throttle_*`` setting, with its default (see README, "Settings")."""

    #: Where window state and the lines live: ``redis://``, ``rediss://``,
    #: ``sentinel://`` (or ``redis+sentinel://``), ``redis+cluster://``. (Not in the
    #: repr: it may hold a password; in ``app.conf`` it is masked, see hide_secrets.)
    redis_url: str | None = field(default=_DEFAULT_REDIS, repr=False)
    #: Passed to the redis-py client: TLS certificates, ``username``/``password``,
    #: timeouts; for Sentinel ``master_name`` and ``sentinel_kwargs`` (connection.py).
    #: (Not in the repr; Celery masks its ``password`` keys, nested ones too, by name.)
    redis_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: Every Redis key the plugin writes starts with it.
    key_prefix: str = "throttle"
    #: Limits for tasks by name glob, for tasks you do not own.
    rules: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: "sliding" or "fixed".
    default_algorithm: str = "sliding"
    #: What a task does when Redis cannot be reached: "defer", "allow" or "fail".
    on_store_error: str = "defer"
    #: How often (seconds) each worker does its chores: lost index entries, the store's
    #: watch (the lines themselves are released when due).
    release_interval: float = 1.0
    #: False turns every throttle off (tests, an emergency): tasks run unchecked, and the
    #: worker says so when it starts.
    enabled: bool = True
    #: "enforce", or "shadow": every task's throttle of the app counts and reports what it
    #: would hold back, and holds nothing (per throttle: mode=; live: Throttle.set_mode); a
    #: direct ``Throttle.acquire`` is always enforced.
    mode: str = "enforce"
    #: Whether the producer checks a throttled task when it sends it, and defers one
    #: that does not fit (so floods of one key never queue in front of other keys).
    check_at_publish: bool = True
    #: A denied task whose reserved start would be further away than this (seconds)
    #: fails with WaitTooLong instead of waiting; None: no cap. Per throttle: max_wait.
    max_wait: float | None = None
    #: Seconds added to every sliding window (per throttle: margin=): any two starts N
    #: apart are then at least a window plus this apart, so that the requests they make
    #: still arrive a window apart at an API that limits them (its clock, and the time
    #: from a task's start to its request reaching it, differ from ours). None: 2% of
    #: each window, at most 20 ms (timing.MARGIN_SHARE); 0: none.
    margin: float | None = None
    #: How long (seconds) a concurrency slot stays held without a renewal: the worker
    #: holding it renews it while the body runs, so this bounds how long a slot of a
    #: worker that died (SIGKILL, a lost host) stays taken before it is reclaimed.
    concurrency_lease: float = 30.0
    #: Label metrics by key as well as scope (a tenant id per label value: unbounded).
    metrics_keys: bool = False
    #: Keep a copy of every task waiting in a line in the broker's journal queue, so that
    #: a store that loses them (restarted empty, evicting) loses none: the keeper sends
    #: them on. None: when the broker is RabbitMQ (check/journaling.py says why).
    journal: bool | None = None
    #: Send a task released because a body ended to that body's worker, through a queue of
    #: its own (``<worker>.throttle-hand``): the slot and the process that freed are used
    #: at once, whatever the prefetch (celery_parts/hand.py). On a Redis broker only:
    #: RabbitMQ gives a released task to a worker with room by itself.
    hand_off: bool = True
    #: Keep a record of about this many events (each task's arrival, start and end) in the
    #: store, for ``throttle simulate`` to replay against proposed limits; 0: none.
    record: int = 0
    #: Backoff (seconds) for tasks deferred because Redis could not be reached.
    store_retry_delay: float = 1.0
    store_retry_max_delay: float = 30.0

    @classmethod
    def from_app(cls, app: Any, overrides: Mapping[str, Any] | None = None) -> Settings:
        """Read ``throttle_*`` from ``app.conf``; ``overrides`` (without prefix) win."""
        names = {f.name for f in fields(cls)}
        overrides = dict(overrides or {})
        unknown = set(overrides) - names
        if unknown:
            raise ConfigurationError(
                f"unknown throttle setting(s) {sorted(unknown)}; known: {sorted(names)}"
            )
        _warn_unknown(app, names | {_SECRET_URL[len("throttle_"):]})
        hide_secrets(app)
        values: dict[str, Any] = {}
        for name in names:
            conf_value = app.conf.get(f"throttle_{name}")
            if conf_value is not None:
                values[name] = conf_value
        secret = app.conf.get(_SECRET_URL)
        if secret and values.get("redis_url") == safe_url(secret):
            values["redis_url"] = secret  # (the URL as given: see hide_secrets)
        values.update(overrides)
        if "redis_url" not in values:
            values["redis_url"] = _default_redis_url(app)
            if "redis_options" not in values and str(values["redis_url"]).startswith(SENTINEL_SCHEMES):
                values["redis_options"] = _broker_sentinel_options(app)
        return cls(**values).validated()

    def validated(self) -> Settings:
        check_prefix(self.key_prefix)
        if self.default_algorithm not in ALGORITHMS:
            raise ConfigurationError(
                f"throttle_default_algorithm {self.default_algorithm!r}: use one of {ALGORITHMS}"
            )
        check_mode(self.mode, "throttle_mode")
        if isinstance(self.record, bool) or not isinstance(self.record, int) or self.record < 0:
            raise ConfigurationError(f"throttle_record is a number of events to keep (0: none), got {self.record!r}")
        if self.on_store_error not in STORE_ERROR_POLICIES:
            raise ConfigurationError(
                f"throttle_on_store_error {self.on_store_error!r}: use one of {STORE_ERROR_POLICIES}"
            )
        if not isinstance(self.redis_options, Mapping):
            raise ConfigurationError("throttle_redis_options must be a dict of redis-py client options")
        if self.redis_url is not None and not isinstance(self.redis_url, str):
            # (its type, not its value: a URL given as bytes holds its password all the same)
            raise ConfigurationError(f"throttle_redis_url must be a URL string, got a {type(self.redis_url).__name__}")
        if self.redis_url is not None:
            check_store_url(self.redis_url)
        if not isinstance(self.rules, Mapping):
            raise ConfigurationError("throttle_rules must be a dict of task-name glob -> options")
        check_max_wait(self.max_wait, "throttle_max_wait")
        check_margin(self.margin, "throttle_margin")
        if not isinstance(self.metrics_keys, bool):
            raise ConfigurationError("throttle_metrics_keys must be True or False")
        if not isinstance(self.enabled, bool):
            raise ConfigurationError("throttle_enabled must be True or False")
        if self.journal is not None and not isinstance(self.journal, bool):
            raise ConfigurationError("throttle_journal must be True, False or None (None: on with a RabbitMQ broker)")
        if not isinstance(self.hand_off, bool):
            raise ConfigurationError("throttle_hand_off must be True or False")
        if not isinstance(self.check_at_publish, bool):
            raise ConfigurationError("throttle_check_at_publish must be True or False")
        for name in ("release_interval", "store_retry_delay", "store_retry_max_delay",
                     "concurrency_lease"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ConfigurationError(f"throttle_{name} must be a positive number of seconds")
        return self


#: Where the store's URL is kept when it holds a password: Celery shows the value of no
#: setting whose name says SECRET (``celery report``, ``celery inspect conf``).
_SECRET_URL = "throttle_redis_secret_url"
_URL = "throttle_redis_url"
#: On the app: the masked URLs hide_secrets wrote over a config source's, by spelling,
#: with the value each masks.
_HIDDEN = "_celery_throttle_hidden"


def hide_secrets(app: Any) -> None:
    """Keep the store's password out of everything that shows ``app.conf``.

    Celery masks a setting by its name (``celery.app.utils.filter_hidden_settings``: PASS,
    SECRET, KEY, ..., in dicts too) and the URL of a few of its own (``broker_url``);
    ``throttle_redis_url`` is neither, and ``celery report`` and ``celery inspect conf``
    would print its password. A ``throttle_redis_url`` with one becomes the masked URL,
    under each spelling it is set in (``CELERY_THROTTLE_REDIS_URL`` under a Django
    namespace), and the URL itself moves to ``throttle_redis_secret_url``, which Celery
    masks, for :meth:`Settings.from_app` to read. ``throttle_redis_options`` needs none of
    this: Celery masks its ``password`` keys (``sentinel_kwargs``'s too) by name.

    Idempotent; reads ``app.conf`` (which loads a pending configuration): ``install`` calls
    it when the app is configured, from ``on_after_configure``, and before a ``celery``
    command imports the task modules (``import_modules``).
    """
    try:
        _put_back(app)
        url = app.conf.get(_URL)
        if not isinstance(url, str) or safe_url(url) == url:
            return
        conf = app.conf  # (read again: the configuration that get loaded, if it was pending)
        maps = getattr(conf, "maps", None) or [conf]  # (a ChainMap: the app's changes first, then the sources)
        hidden = app.__dict__.setdefault(_HIDDEN, {})
        conf[_SECRET_URL] = url
        for spelling in _spellings(conf, _URL):
            held = next((m[spelling] for m in maps if spelling in m), None)
            if isinstance(held, str) and safe_url(held) != held:
                if spelling not in maps[0]:  # (a source's, not one of the app's own changes)
                    hidden[spelling] = (safe_url(held), held)
                conf[spelling] = safe_url(held)
    except Exception:  # noqa: BLE001 - a conf we cannot rewrite keeps its value: never fail for it
        return


def _put_back(app: Any) -> None:
    """The app's changes outlive a reload of its config source (``config_from_object`` a
    second time): a masked URL written there over the source's URL would hide the URL the
    source gives now, and the old one be used. Where the source gives another, the masked
    one goes (the new one is masked in its turn)."""
    hidden = app.__dict__.get(_HIDDEN)
    if not hidden:
        return
    maps = getattr(app.conf, "maps", None) or [app.conf]
    changes, sources = maps[0], maps[1:]
    for spelling, (masked, held) in list(hidden.items()):
        now = next((m[spelling] for m in sources if spelling in m), None)
        if changes.get(spelling) != masked:
            del hidden[spelling]  # (set since by the app itself)
        elif now != held:
            del changes[spelling], hidden[spelling]


def _spellings(conf: Any, name: str) -> list[str]:
    """``name`` as Celery reads it from ``conf``: as it is, and after the conf's namespace
    in the namespace's case (celery.utils.text.match_case), e.g. CELERY_THROTTLE_REDIS_URL."""
    namespace = getattr(conf, "prefix", None) or ""
    if not namespace:
        return [name]
    spelt = namespace + name
    return [spelt.upper() if namespace.isupper() else spelt.lower(), name]


def check_mode(value: Any, what: str) -> None:
    if value not in MODES:
        raise ConfigurationError(f"{what} {value!r}: use one of {MODES}")


def check_max_wait(value: Any, what: str) -> None:
    """A wait cap is a positive number of seconds, or None for none."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConfigurationError(f"{what} must be a positive number of seconds or None, got {value!r}")


#: The largest margin: more is a different rate, not a margin (write "10/2s" then).
MAX_MARGIN = 60.0


def check_margin(value: Any, what: str) -> None:
    """A margin is a number of seconds, 0 to MAX_MARGIN, or None for the setting's."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 <= value <= MAX_MARGIN):
        raise ConfigurationError(f"{what} must be a number of seconds from 0 to {MAX_MARGIN:.0f}, got {value!r}")


def _default_redis_url(app: Any) -> str | None:
    """The broker's URL when the broker is a Redis; None with any other broker: there is
    no Redis to guess (a silent localhost would defer every task forever on a machine that
    has none), and :func:`require_redis_url` says so when the store is first needed."""
    broker = app.conf.broker_url
    if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
        return broker.split(";")[0]
    if isinstance(broker, str) and broker.startswith(SENTINEL_SCHEMES):
        return broker  # every Sentinel of the list: any one of them finds the master
    if not broker:
        return _DEFAULT_REDIS  # Celery's own default broker is local too
    return None


def _broker_sentinel_options(app: Any) -> dict[str, Any]:
    """The Sentinel group a Sentinel broker names (kombu's transport options)."""
    transport = app.conf.broker_transport_options or {}
    return {k: transport[k] for k in ("master_name", "sentinel_kwargs") if k in transport}


def require_redis_url(app: Any, settings: Settings) -> str:
    """The store's URL, or a clear error naming the setting to give."""
    if settings.redis_url:
        return settings.redis_url
    scheme = str(app.conf.broker_url).split("://", 1)[0]
    raise ConfigurationError(
        f"the broker is {scheme}://, not a Redis: set throttle_redis_url to the Redis that "
        "holds the throttle's windows (e.g. app.conf.throttle_redis_url = 'redis://host:6379/0')"
    )


def _warn_unknown(app: Any, names: set[str]) -> None:
    """A misspelt setting would be ignored without a word: say so, with the known name
    nearest to it, in the spelling it was given (a warning, not an error: another package
    may share the prefix). Celery reads ``throttle_rules`` as it is and, under
    ``config_from_object(..., namespace="CELERY")`` (Django), as ``CELERY_THROTTLE_RULES``."""
    try:
        keys = [k for k in app.conf if isinstance(k, str)]
        namespace = app.conf.prefix or ""  # e.g. "CELERY_"; "" without a namespace
    except Exception:  # noqa: BLE001 - a conf we cannot list is not worth failing for
        return
    for key in sorted(keys):
        advice = _unknown_setting(key, names, namespace)
        if advice is not None:
            logger.warning("celery_throttle: unknown setting %s is ignored%s", key, advice)


#: The name every setting's spelling has after its namespace.
_PREFIX = "throttle_"
#: A namespace Django projects use: a ``CELERY_THROTTLE_*`` setting read without it is
#: ignored, and the advice says how to read it.
_DJANGO_NAMESPACE = "CELERY_"


def _unknown_setting(key: str, names: set[str], namespace: str) -> str | None:
    """None for a setting we read, or one that is not ours; else the advice (" (did you
    mean ...?)", or "") that follows "unknown setting KEY is ignored"."""
    def spelt(name: str, spelling_prefix: str) -> str:
        # Celery's own rule: a namespace's case is the whole key's (celery.utils.text.match_case).
        whole = spelling_prefix + _PREFIX + name
        return whole.upper() if spelling_prefix.isupper() else whole.lower()

    def nearest(rest: str) -> str | None:
        close = difflib.get_close_matches(rest.lower(), sorted(names), n=1)
        return close[0] if close else None

    lowered = key.lower()
    if namespace and lowered.startswith((namespace + _PREFIX).lower()):
        rest = key[len(namespace) + len(_PREFIX):]
        if any(key == spelt(name, namespace) for name in names):
            return None
        close = nearest(rest)
        return f" (did you mean {spelt(close, namespace)}?)" if close else ""
    if lowered.startswith(_PREFIX):
        rest = key[len(_PREFIX):]
        if key.startswith(_PREFIX) and rest in names:
            return None
        close = nearest(rest)
        if close is None:
            return ""
        # An upper-case THROTTLE_KEY_PREFIX means the namespace's spelling, if there is one.
        return f" (did you mean {spelt(close, namespace if key.isupper() and namespace.isupper() else '')}?)"
    if not namespace and lowered.startswith((_DJANGO_NAMESPACE + _PREFIX).lower()):
        rest = key[len(_DJANGO_NAMESPACE) + len(_PREFIX):].lower()
        how = f"app.config_from_object(..., namespace={_DJANGO_NAMESPACE[:-1]!r}) reads {_DJANGO_NAMESPACE}THROTTLE_*"
        if rest in names:
            return f" (this app has no namespace: {how}, or spell it {spelt(rest, '')})"
        close = nearest(rest)
        return f" (did you mean {spelt(close, _DJANGO_NAMESPACE)}? and {how})" if close else f" ({how})"
    return None
