"""``celery -A proj throttle ...``: inspect and reset limits, see parked tasks.

Registered under the ``celery.commands`` entry point group, as Flower does.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

import click
from kombu.exceptions import ContentDisallowed, DecodeError

from .broker_parking import broker_parking
from .connection import safe_url
from .controller import controller
from .errors import ThrottleError
from .keys import target_matches
from .messages import decode_message
from .why import REPLY_TIMEOUT, explain

__all__ = ["throttle"]


def _controller(ctx: click.Context) -> Any:
    return controller(ctx.obj.app)


class _Group(click.Group):
    """Says what went wrong in one line (Redis unreachable, a bad setting), no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        # Each command prints what it did: the library's own log lines would say it twice.
        logging.getLogger("celery_throttle").setLevel(logging.ERROR)
        try:
            return super().invoke(ctx)
        except ThrottleError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(name="throttle", cls=_Group)
def throttle() -> None:
    """Global rate limits (celery_throttle)."""


@throttle.command()
@click.argument("scope", required=False)
@click.option("--key", default=None, help="The key (e.g. tenant id) within the scope.")
@click.option("--match", default="*", show_default=True, help="Without SCOPE: list only scopes matching this glob.")
@click.option("--key-match", default=None, metavar="GLOB",
              help="List only keys matching this glob (default: every key, and the scopes without one).")
@click.option("--limit", default=200, show_default=True, help="Without SCOPE: list at most this many.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_context
def status(ctx: click.Context, scope: str | None, key: str | None, match: str, key_match: str | None, limit: int,
           as_json: bool) -> None:
    """Show usage per rate, the tasks waiting in each line, concurrency slots, pauses and
    live limits, consuming nothing.

    Without SCOPE: every scope and key Redis holds a window, a line, a pause or a live
    limit for (found by SCAN). Times are local, with their zone.
    """
    ctl = _controller(ctx)
    spelt: list[tuple[str, str]] = []
    if scope is None:
        found, more = ctl.statuses(match=match, limit=limit, key_match=key_match)
        if not found and key_match is None and ":" in match:
            found, more, spelt = _as_scope_and_key(ctl, match, limit)
    elif key is None and (found_keys := ctl.statuses(limit=limit, scope=scope, key_match=key_match))[0]:
        found, more = found_keys  # the scope's own row and every key of it
    else:
        found, more = [ctl.status(scope, key=key)], False
        if _empty(found[0]):
            known = ctl.known_scopes()
            if scope not in known and not as_json:
                listed = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "") or "none"
                raise click.ClickException(f"no such scope {scope!r}: nothing counted, paused or limited "
                                           f"for it, and no task of this app uses it; known scopes: {listed}")
    parked = ctl.parking.parked_count()
    if as_json:
        click.echo(json.dumps({"keys": [_as_dict(s) for s in found], "more": more,
                               "parked": dict(zip(("waiting", "in_flight", "dead"), parked))}, indent=2))
        return
    if scope is not None and _empty(found[0]):
        click.echo(f"{_target(scope, key)}: nothing counted")
        return
    for scope_glob, key_glob in spelt:
        click.echo(f"no scope matches {match!r}; shown: the keys it names, as --match {scope_glob!r} "
                   f"--key-match {key_glob!r}")
    _table(found, more, parked, scope is None)
    if not found and scope is None:
        click.echo(_nothing_matched(match, key_match) if match != "*" or key_match is not None
                   else "no throttled scope has anything counted, waiting, paused or limited")


def _as_scope_and_key(ctl: Any, match: str, limit: int) -> tuple[list[Any], bool, list[tuple[str, str]]]:
    """What ``--match 'scope:key'`` names, the shape every key is shown in (and the
    spelling of an earlier version): each split at a ``:`` tried as a scope glob and a key
    glob. Returns the statuses, whether more were left, and the splits that matched."""
    found: dict[tuple[str, str | None], Any] = {}
    more, spelt = False, []
    for at in (i for i, c in enumerate(match) if c == ":"):
        scope_glob, key_glob = match[:at], match[at + 1:]
        listed, left = ctl.statuses(match=scope_glob, limit=limit, key_match=key_glob)
        if listed:
            spelt.append((scope_glob, key_glob))
            more |= left
            found.update(((s.scope, s.key), s) for s in listed)
    return sorted(found.values(), key=lambda s: (s.scope, s.key is not None, s.key or "")), more, spelt


def _nothing_matched(match: str, key_match: str | None) -> str:
    line = f"nothing matched --match {match!r}" + ("" if key_match is None else f" --key-match {key_match!r}")
    line += " (--match selects scopes, --key-match keys"
    if key_match is None and ":" in match:
        scope_glob, _, key_glob = match.partition(":")
        line += f": a key of a scope is --match {scope_glob!r} --key-match {key_glob!r}"
    return line + ")"


def _empty(status: Any) -> bool:
    """Nothing counted, paused, limited, running or waiting."""
    return not (status.rates or status.paused_until is not None or status.live_limit or status.live_concurrency
                or status.running or status.waiting)


def _target(scope: str, key: str | None) -> str:
    """A scope and key as the CLI names them (quoted: user data, printed as it is)."""
    return f"scope {scope!r}" + ("" if key is None else f" key {key!r}")


def _slots(status: Any) -> str:
    """The slots cell of a row: "2/4" (held of the limit; "(live)" when a live limit sets it)."""
    if not (status.concurrency or status.running):
        return ""
    return f"{status.running}/{status.concurrency or '?'}" + (" (live)" if status.live_concurrency else "")


def _waiting(status: Any) -> str:
    """The waiting cell of a row: tasks in the line, and "+n out" released and not started."""
    if not (status.waiting or status.released):
        return ""
    return str(status.waiting) + (f" +{status.released} out" if status.released else "")


def _as_dict(status: Any) -> dict[str, Any]:
    return {
        "scope": status.scope, "key": status.key,
        **_pause_fields(status.paused_until),
        "live_limit": [str(r) for r in status.live_limit] if status.live_limit else None,
        "waiting": status.waiting, "released": status.released,
        "running": status.running, "concurrency": status.concurrency,
        "live_replaces_all": status.live_replaces_all,
        "live_concurrency": status.live_concurrency,
        "rates": [{"rate": str(r.rate), "algorithm": r.algorithm, "used": r.used, "remaining": r.remaining,
                   "reset_at": _iso(r.reset_at)} for r in status.rates],
    }


def _table(found: list[Any], more: bool, parked: tuple[int, int, int], listing: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    zone = dt.datetime.now().astimezone().strftime("%Z")
    table = Table(box=None, pad_edge=False, header_style="bold")
    # (Columns only when they say something: 80 columns.)
    waiting = any(s.waiting or s.released for s in found)
    slots = any(s.concurrency or s.running for s in found)
    counted = any(s.rates or s.live_limit for s in found)
    paused_any = any(s.paused_until is not None for s in found)
    shown = {"waiting": waiting, "slots": slots, "rate": counted, "used": counted, "left": counted,
             f"resets ({zone})": counted, "paused": paused_any}
    for name, justify in (("scope", "left"), ("key", "left"), ("rate", "right"), ("used", "right"),
                          ("left", "right"), (f"resets ({zone})", "right"), ("waiting", "right"), ("slots", "right"),
                          ("paused", "left")):
        if shown.get(name, True):
            table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for s in found:
        paused = "" if s.paused_until is None else (
            "until resumed" if s.paused_until == float("inf") else f"until {_clock(s.paused_until)}")
        live = set(s.live_limit or ())
        # A row per stored rate, marked when a live limit sets it (or, set with --replace,
        # lifts it); a scope with only a control (a pause, a live limit) gets one row for it.
        rows = [(f"{r.rate}{_mark(r.rate, live, s.live_replaces_all)}", str(r.used), str(r.remaining),
                 _clock(r.reset_at))
                for r in s.rates] or [(", ".join(f"{r} (live)" for r in sorted(live)) or "-", "", "", "")]
        for i, (rate, used, left, resets) in enumerate(rows):
            first = i == 0
            # Scopes and keys are user data: Text, never read as rich markup ("[red]acme").
            cells = [Text(_escaped(s.scope)) if first else "", Text("-" if s.key is None else _escaped(s.key)) if first else "",
                     *([rate, used, left, resets] if counted else []),
                     *([_waiting(s) if first else ""] if waiting else []),
                     *([_slots(s) if first else ""] if slots else []), *([paused if first else ""] if paused_any else [])]
            table.add_row(*cells)
    console = Console(width=None if Console().is_terminal else 80, soft_wrap=False)
    if found:
        console.print(table)
    if more:
        click.echo("... more not shown (narrow with --match, or raise --limit)")
    if waiting:
        click.echo("waiting: tasks in the key's line, waiting for room (+ released to a worker, not started yet)")
    if slots:
        click.echo("slots: concurrency slots held (bodies running) of the limit")
    if listing and any(parked):
        click.echo(f"parked by an earlier version: {parked[0]} waiting, {parked[1]} being released, "
                   f"{parked[2]} dead")


@throttle.command(name="set")
@click.argument("scope")
@click.argument("rates", nargs=-1)
@click.option("--key", default=None, help="Set it for this key only (e.g. a tenant id); default: the whole scope.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, metavar="K",
              help="At most K bodies of the scope (or key) run at once.")
@click.option("--replace", is_flag=True,
              help="The RATES alone are in force: the declared rates of other windows are lifted too.")
@click.pass_context
def set_limit(ctx: click.Context, scope: str, rates: tuple[str, ...], key: str | None,
              concurrency: int | None, replace: bool) -> None:
    """Limit SCOPE (or its KEY) to RATES, e.g. 5/s "30000 tokens/m", and (--concurrency)
    to K running at once, instead of what the code declares.

    A rate takes the place of the declared rate of its window (2/s for 10/s); the
    declared rates of other windows (5000/h) stay in force, unless --replace. Prints the
    rates then in force. Every worker obeys within a second, until `throttle unset`.
    Without --key it applies to every key of the scope that has no limit of its own. A
    raised K sends tasks waiting for a slot at once.
    """
    if not rates and concurrency is None:
        raise click.UsageError("give RATES, --concurrency K, or both")
    if replace and not rates:
        raise click.UsageError("--replace replaces the declared rates: give RATES")
    ctl = _controller(ctx)
    parsed = ctl.set_limit(scope, list(rates) if rates else None, key=key, concurrency=concurrency, replace=replace)
    parts = ([f"limit set to {', '.join(map(str, parsed))}" + (" in place of every declared rate" if replace else "")]
             if rates else []) + ([f"concurrency set to {concurrency}"] if concurrency is not None else [])
    click.echo(f"{_target(scope, key)}: {'; '.join(parts)}")
    if rates:
        click.echo(_in_force(ctl, scope, key, set(parsed)))


def _in_force(ctl: Any, scope: str, key: str | None, live: set[Any]) -> str:
    """The line that says which rates are in force after a live limit: each one, live or
    declared, and the declared ones it lifted."""
    declared, by_callable = ctl.declared_rates(scope)
    rates = ctl.rates_in_force(scope, key)
    line = "in force: " + ", ".join(f"{r} ({'live' if r in live else 'declared'})" for r in sorted(rates, key=_by_window))
    windows = {(r.period_us, r.unit) for r in live}
    lifted = sorted((r for r in declared if r not in rates and (r.period_us, r.unit) not in windows), key=_by_window)
    if lifted:
        line += f"; lifted until `throttle unset`: {', '.join(map(str, lifted))}"
    if by_callable:
        line += "; and the rates of other windows that a task's rate callable returns, per call"
    elif not declared:
        line += " (no task of this app declares rates for it)"
    return line


def _by_window(rate: Any) -> tuple[int, str, int]:
    """Rates as people read them: the shortest window first."""
    return rate.period_us, rate.unit, rate.limit


@throttle.command(name="unset")
@click.argument("scope")
@click.option("--key", default=None, help="The key whose own limit to remove.")
@click.pass_context
def unset_limit(ctx: click.Context, scope: str, key: str | None) -> None:
    """Remove the live limit of SCOPE (or its KEY): back to the rates and concurrency in
    the code."""
    found = _controller(ctx).clear_limit(scope, key=key)
    click.echo(f"{_target(scope, key)}: " + ("back to the code's limits" if found else "no live limit set"))


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="Pause only this key (e.g. a tenant id) of the scope.")
@click.option("--for", "duration", default=None, metavar="DURATION",
              help="How long: 90s, 5m, 2h, 1d or seconds (default: until resumed).")
@click.pass_context
def pause(ctx: click.Context, scope: str, key: str | None, duration: str | None) -> None:
    """Start nothing of SCOPE (or of its KEY) on any worker, for a while or until resumed.

    Tasks that arrive meanwhile wait in their key's line and run after it; none is failed
    by it. Every worker obeys within a second.
    """
    until = _controller(ctx).pause(scope, key=key, seconds=_duration(duration))
    click.echo(f"paused {_target(scope, key)} {_until(until)}")


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="Resume only this key of the scope.")
@click.pass_context
def resume(ctx: click.Context, scope: str, key: str | None) -> None:
    """End a pause of SCOPE (or of its KEY) now: the tasks it held go as their keys have room."""
    found = _controller(ctx).resume(scope, key=key)
    click.echo(f"resumed {_target(scope, key)}" if found else f"{_target(scope, key)} was not paused")


@throttle.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check the store: can it evict or lose the tasks waiting in its lines, and its counts?
    Exit 1 if so."""
    ctl = _controller(ctx)
    report = ctl.store.report()
    click.echo(f"store {safe_url(ctl.store.url)} (run id {(report.run_id or '?')[:8]})")
    for risk in report.risks:
        click.echo(f"RISK: {risk}")
    for what in report.unchecked:
        click.echo(f"not checked: {what}")
    if not report.risks and not report.unchecked:
        click.echo("ok: no eviction, and it keeps its data on disk")
    if report.risks:
        ctx.exit(1)


@throttle.command()
@click.argument("task_id")
@click.option("--timeout", default=REPLY_TIMEOUT, show_default=True, help="Seconds to wait for the workers' answers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_context
def why(ctx: click.Context, task_id: str, timeout: float, as_json: bool) -> None:
    """Where task TASK_ID waits, until when, and what holds it.

    In its key's line (the store: its place, and an estimate of its start), released and
    on its way, or held by a worker: a countdown, received and waiting for a pool
    process, or running.
    """
    found = explain(_controller(ctx), task_id, timeout)
    if as_json:
        click.echo(json.dumps(_whereabouts_dict(found), indent=2))
        return
    for line in _whereabouts_lines(found):
        click.echo(line)


_WHERE = {
    "line": "waiting in the line of {target}",
    "released": "released from the line of {target}, on its way to a worker",
    "parked": "parked in the store by an earlier version, due {until}",
    "releasing": "being sent back from the store (taken at {until})",
    "dead": "a dead letter since {until}: it could not be sent back (throttle parked --dead)",
    "delayed": "parked in the broker's delay queues, due in its queue at {until}",
    "held": "held in the broker until the pause holding it is over",
    "countdown": "held by worker {worker} as a countdown until {until}",
    "received": "received by worker {worker}, waiting for a pool process",
    "running": "running on worker {worker}",
}


def _whereabouts_lines(found: Any) -> list[str]:
    head = f"task {found.task_id}" + (f" ({found.name})" if found.name else "")
    if found.where == "unknown":
        return [(f"{head}: not waiting in the throttle: it is not parked, and none of the {found.workers_asked} "
                "worker(s) that answered holds it (it may be in a queue no worker has taken it from yet, done, "
                "or unknown)")]
    until = "?" if found.until is None else f"{_when(found.until)} ({_from_now(found.until)})"
    target = _target(found.scope or "?", found.key)
    lines = [f"{head}: {_WHERE[found.where].format(until=until, worker=found.worker, target=target)}"]
    if found.where == "line":
        estimate = "" if found.start is None else (f"; it may start about {_when(found.start)} "
                                                   f"({_from_now(found.start)})")
        lines.append(f"{target}: place {found.place} of {found.waiting} waiting{estimate}")
    elif found.scope is not None and found.where != "released":
        lines.append(target)
    if found.held_by_pause or found.paused_until is not None:
        lines.append("held by: a pause " + ("that has ended" if found.paused_until is None else _until(found.paused_until)))
    elif found.concurrency and found.running is not None and found.running >= found.concurrency:
        lines.append(f"held by: its concurrency limit ({found.running} of {found.concurrency} slots held); the next "
                     "slot to free goes to the head of the line")
    elif found.fullest is not None and found.where in ("line", "countdown", "received", "parked"):
        r = found.fullest
        lines.append(f"held by: the rate {r.rate} ({r.used} used, {r.remaining} left now, resets "
                     f"{_when(r.reset_at)})")
    return lines


def _whereabouts_dict(found: Any) -> dict[str, Any]:
    r = found.fullest
    return {
        "task_id": found.task_id, "where": found.where, "name": found.name, "scope": found.scope, "key": found.key,
        "until": None if found.until is None else _iso(found.until),
        "estimated_start": None if found.start is None else _iso(found.start), "worker": found.worker,
        "held_by_pause": found.held_by_pause,
        **_pause_fields(found.paused_until),
        "fullest_rate": None if r is None else {"rate": str(r.rate), "used": r.used, "remaining": r.remaining,
                                                "reset_at": _iso(r.reset_at)},
        "line": None if found.where != "line" else {"place": found.place, "waiting": found.waiting,
                                                    "running": found.running, "concurrency": found.concurrency},
    }


def _pause_fields(paused_until: float | None) -> dict[str, Any]:
    """A pause in JSON: whether there is one, its end (an ISO time, or null: none, or
    open-ended) and whether it lasts until resumed, so that every time field is a time or null."""
    open_ended = paused_until == float("inf")
    return {"paused": paused_until is not None,
            "paused_until": None if paused_until is None or open_ended else _iso(paused_until),
            "paused_until_resumed": open_ended}


def _from_now(timestamp: float) -> str:
    seconds = timestamp - dt.datetime.now().timestamp()
    return f"in {seconds:.1f}s" if seconds >= 0 else f"{-seconds:.1f}s ago"


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="The key (e.g. tenant id) within the scope.")
@click.option("--all-keys", is_flag=True, help="Every key of SCOPE, and the scope's own windows.")
@click.option("--yes", is_flag=True, help="Do not ask first.")
@click.pass_context
def reset(ctx: click.Context, scope: str, key: str | None, all_keys: bool, yes: bool) -> None:
    """Forget the windows of SCOPE (without --key: the scope's own, not its keys'; with
    --all-keys: every key's too). What they counted no longer holds the next starts back.
    Asks first."""
    ctl = _controller(ctx)
    if all_keys:
        if key is not None:
            raise click.UsageError("--all-keys and --key: choose one")
        if not (yes or click.confirm(f"forget what every key of {_target(scope, None)} counted?")):
            raise click.Abort()
        keys = ctl.reset_keys(scope)
        click.echo(f"reset {_target(scope, None)}: {len(keys)} window(s)" if keys
                   else f"{_target(scope, None)}: nothing to reset")
        return
    if not (yes or click.confirm(f"forget what {_target(scope, key)} counted?")):
        raise click.Abort()
    found = ctl.reset(scope, key=key)
    if found:
        click.echo(f"reset {_target(scope, key)}")
        return
    keyed = [st for st in ctl.statuses(scope=scope, limit=2)[0] if st.key is not None] if key is None else []
    click.echo(f"{_target(scope, key)}: nothing to reset"
               + (" (its keys have windows of their own: --key KEY, or --all-keys)" if keyed else ""))


@throttle.command()
@click.option("--tasks", is_flag=True, help="List each waiting task (id, task, scope, key, place) instead of a summary.")
@click.option("--match", default="*", show_default=True, help="Only tasks whose scope matches this glob.")
@click.option("--key-match", default=None, metavar="GLOB", help="Only tasks whose key matches this glob.")
@click.option("--purge", is_flag=True, help="Delete the waiting tasks (those --match selects); asks first.")
@click.option("--send-now", is_flag=True,
              help="Send the waiting tasks (every task of each key --match selects) to their queues now, whatever "
                   "their keys' room: before rolling back to a version without lines. Asks first.")
@click.option("--dead", is_flag=True, help="List the dead letters: tasks whose message could not be sent.")
@click.option("--requeue", is_flag=True, help="Hand every dead letter out again, now (asks first).")
@click.option("--drop", is_flag=True, help="Delete every dead letter (asks first).")
@click.option("--yes", is_flag=True, help="Do not ask before --purge, --send-now, --requeue or --drop.")
@click.pass_context
def parked(ctx: click.Context, tasks: bool, match: str, key_match: str | None, purge: bool, send_now: bool,
           dead: bool, requeue: bool, drop: bool, yes: bool) -> None:
    """Tasks waiting in the lines (in the store, off the broker), by scope and key; dead letters.

    Without options: a summary per scope and key (waiting, released to a worker and not
    started, and since when the oldest waits). A purged task is gone for good: it never
    runs. ``--send-now`` empties the lines into the broker (each task is then checked by
    the worker that takes it), for a rollback to a version that does not read them.
    """
    ctl = _controller(ctx)
    store = ctl.parking
    if dead or requeue or drop:
        _dead_letters(ctl, requeue, drop, yes)
        return
    found = [w for w in ctl.lines.waiting() if target_matches(w.scope, w.key, match, key_match)]
    if purge:
        lined = [w for w in found if w.place]
        if lined and (yes or click.confirm(f"delete {len(lined)} waiting task(s) for good (they never run)?")):
            click.echo(f"purged {ctl.lines.purge(lined)} waiting task(s)")
        elif not lined:
            click.echo("no waiting task to purge")
        return
    if send_now:
        lined = [w for w in found if w.place]
        if lined and (yes or click.confirm(f"send {len(lined)} waiting task(s) to their queues now, whatever "
                                           "their keys' room?")):
            sent, left = ctl.lines.send_now(lined)
            click.echo(f"sent {sent} waiting task(s) to their queues" + (f"; {left} still waiting" if left else ""))
        elif not lined:
            click.echo("no waiting task to send")
        return
    if tasks:
        for w in found:
            where = f"place {w.place}" if w.place else "released"
            click.echo(f"{_escaped(w.task_id)}  {w.name}  {_target(w.scope, w.key)}  {where}  since {_when(w.since)}")
    else:
        groups: dict[tuple[str, str | None], list[Any]] = {}
        for w in found:
            groups.setdefault((w.scope, w.key), []).append(w)
        for (scope, key), listed in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or "")):
            lined = [w for w in listed if w.place]
            oldest = min((w.since for w in listed), default=0.0)
            click.echo(f"{_target(scope, key)}: {len(lined)} waiting, {len(listed) - len(lined)} released, "
                       f"the oldest since {_when(oldest)}")
    if not found:
        click.echo("no task waits in a line")
    count, in_flight, dead_count = store.parked_count()
    if count or in_flight or dead_count:
        click.echo(f"parked by an earlier version: {count} waiting, {in_flight} being released, {dead_count} dead")
    broker = broker_parking(ctl)
    if broker is not None:
        delayed, held = broker.counts()
        if delayed or held:
            click.echo(f"in the broker: {delayed} in its delay queues (of every app on it), {held} held by a pause "
                       "of an earlier version")


def _escaped(text: str) -> str:
    """User data as it is, with its control characters escaped (a newline or an escape
    sequence in an id never reaches the terminal raw)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _dead_letters(ctl: Any, requeue: bool, drop: bool, yes: bool) -> None:
    store = ctl.parking
    letters = store.dead_letters()
    for parked_id, when_us, attempts, message in letters:
        click.echo(f"{parked_id}  {_task_name(ctl.app, message)}  dead since "
                   f"{_when(when_us / 1e6)} after {attempts} attempts")
    ids = [parked_id for parked_id, _, _, _ in letters]
    if requeue and ids and (yes or click.confirm(f"send {len(ids)} dead letter(s) to run again?")):
        click.echo(f"requeued {store.requeue_dead(ids)} dead letter(s)")
    elif drop and ids and (yes or click.confirm(f"delete {len(ids)} dead letter(s) for good?")):
        click.echo(f"dropped {store.drop_dead(ids)} dead letter(s)")
    if not letters:
        click.echo("no dead letters")


def _task_name(app: Any, message: bytes | None) -> str:
    if message is None:
        return "<message gone>"
    try:
        return str(decode_message(app, message).get("task"))
    except (ValueError, TypeError, AttributeError, DecodeError, ContentDisallowed):
        return "<cannot be decoded>"  # the reason it is a dead letter, often


def _when(timestamp: float) -> str:
    """A time as people on call read it: local, with its zone."""
    return dt.datetime.fromtimestamp(timestamp).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _mark(rate: Any, live: set[Any], replaces_all: bool) -> str:
    if rate in live:
        return " (live)"
    return " (not in force)" if replaces_all else ""


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="milliseconds")


def _clock(timestamp: float) -> str:
    """A time in a table: the clock only when it is today."""
    moment = dt.datetime.fromtimestamp(timestamp).astimezone()
    today = dt.datetime.now().astimezone().date()
    return moment.strftime("%H:%M:%S" if moment.date() == today else "%Y-%m-%d %H:%M:%S")


def _until(timestamp: float) -> str:
    return "until resumed" if timestamp == float("inf") else f"until {_when(timestamp)}"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str | None) -> float | None:
    """90s, 5m, 2h, 1d, or a number of seconds; None stays None."""
    if text is None:
        return None
    value, unit = text.strip(), "s"
    if value[-1:].lower() in _UNITS:
        value, unit = value[:-1], value[-1].lower()
    try:
        seconds = float(value) * _UNITS[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r}: use e.g. 90s, 5m, 2h, 1d", param_hint="--for") from None
    if not seconds > 0:
        raise click.BadParameter(f"{text!r}: must be more than 0", param_hint="--for")
    return seconds
