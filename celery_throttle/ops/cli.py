"""``celery -A proj throttle ...``: inspect and reset limits, see parked tasks.

Registered under the ``celery.commands`` entry point group, as Flower does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click

from ..check.controller import controller
from ..core.errors import ThrottleError
from ..core.urls import safe_url
from ..waits.why import REPLY_TIMEOUT, explain
from . import show
from . import simulate as simulation
from .parked import parked

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
        if show.empty(found[0]):
            known = ctl.known_scopes()
            if scope not in known and not as_json:
                listed = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "") or "none"
                raise click.ClickException(f"no such scope {scope!r}: nothing counted, paused or limited "
                                           f"for it, and no task of this app uses it; known scopes: {listed}")
    dead = ctl.store.dead_count()
    if as_json:
        click.echo(json.dumps({"keys": [show.as_dict(s) for s in found], "more": more, "dead_letters": dead},
                              indent=2))
        return
    if scope is not None and show.empty(found[0]):
        click.echo(f"{show.scope_and_key(scope, key)}: nothing counted")
        return
    for scope_glob, key_glob in spelt:
        click.echo(f"no scope matches {match!r}; shown: the keys it names, as --match {scope_glob!r} "
                   f"--key-match {key_glob!r}")
    show.status_table(found, more, dead, scope is None)
    if not found and scope is None:
        click.echo(show.nothing_matched(match, key_match) if match != "*" or key_match is not None
                   else "no throttled scope has anything counted, waiting, paused or limited")


def _as_scope_and_key(ctl: Any, match: str, limit: int) -> tuple[list[Any], bool, list[tuple[str, str]]]:
    """What ``--match 'scope:key'`` names, the shape every key is shown in: each split at a
    ``:`` tried as a scope glob and a key glob. Returns the statuses, whether more were left, and the splits that matched."""
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
    click.echo(f"{show.scope_and_key(scope, key)}: {'; '.join(parts)}")
    if rates:
        click.echo(show.in_force(ctl, scope, key, set(parsed)))


@throttle.command(name="unset")
@click.argument("scope")
@click.option("--key", default=None, help="The key whose own limit to remove.")
@click.pass_context
def unset_limit(ctx: click.Context, scope: str, key: str | None) -> None:
    """Remove the live limit of SCOPE (or its KEY): back to the rates and concurrency in
    the code."""
    found = _controller(ctx).clear_limit(scope, key=key)
    click.echo(f"{show.scope_and_key(scope, key)}: " + ("back to the code's limits" if found else "no live limit set"))


@throttle.command()
@click.argument("mode", type=click.Choice(["shadow", "enforce", "clear"]))
@click.argument("scope", required=False)
@click.option("--key", default=None, help="Only this key of the scope.")
@click.pass_context
def mode(ctx: click.Context, mode: str, scope: str | None, key: str | None) -> None:
    """Put SCOPE (or its KEY; no SCOPE: every throttle of the app) in shadow mode, back in
    enforce mode, or clear the mode set here (back to the code's and throttle_mode).

    In shadow mode a throttle counts and reports what it would hold back (throttle status,
    the metrics, the workers' summary) and holds nothing: the tasks waiting in its lines go
    at once. Every worker obeys within a second.
    """
    ctl = _controller(ctx)
    target = "every throttle of the app" if scope is None else show.scope_and_key(scope, key)
    if mode == "clear":
        found = ctl.clear_mode(scope, key=key)
        click.echo(f"{target}: " + ("back to the mode in the code" if found else "no mode set here"))
        return
    ctl.set_mode(mode, scope, key=key)
    click.echo(f"{target}: {mode} mode")


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
    until = _controller(ctx).pause(scope, key=key, seconds=show.duration(duration))
    click.echo(f"paused {show.scope_and_key(scope, key)} {show.pause_end(until)}")


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="Resume only this key of the scope.")
@click.pass_context
def resume(ctx: click.Context, scope: str, key: str | None) -> None:
    """End a pause of SCOPE (or of its KEY) now: the tasks it held go as their keys have room."""
    found = _controller(ctx).resume(scope, key=key)
    click.echo(f"resumed {show.scope_and_key(scope, key)}" if found else f"{show.scope_and_key(scope, key)} was not paused")


@throttle.command()
@click.option("--since", default="10m", show_default=True, metavar="DURATION",
              help="Replay the record of this last span: 90s, 10m, 2h, 1d.")
@click.option("--rate", "rates", multiple=True, metavar="SCOPE[:KEY]=RATES",
              help="Proposed rates of a scope (or one key), e.g. github-api=5/s or api:acme=2/s,100/m. Repeatable.")
@click.option("--concurrency", "slots", multiple=True, metavar="SCOPE[:KEY]=K",
              help="Proposed concurrency limit of a scope (or one key). Repeatable.")
@click.option("--weight", "weights", multiple=True, metavar="SCOPE:KEY=WEIGHT",
              help="Proposed weight of a key in its scope's share of K (share=). Repeatable.")
@click.option("--priority", "priorities", multiple=True, metavar="TASK_NAME=PRIORITY",
              help="Proposed priority (higher first, -255 to 255) of every task of that name. Repeatable.")
@click.option("--fifo", is_flag=True, help="Ignore the tasks' priorities: first come first served.")
@click.option("--file", "path", type=click.Path(dir_okay=False), default=None,
              help="Replay a record exported with --export instead of the store's.")
@click.option("--export", "export", type=click.Path(dir_okay=False), default=None,
              help="Write the span's record to this file (JSON lines) and replay nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_context
def simulate(ctx: click.Context, since: str, rates: tuple[str, ...], slots: tuple[str, ...], weights: tuple[str, ...],
             priorities: tuple[str, ...], fifo: bool, path: str | None, export: str | None, as_json: bool) -> None:
    """Replay what the throttle saw lately (the record: throttle_record) against proposed
    limits, and print what each key would have waited beside what it did wait.

    Nothing is set: try --rate, --concurrency, --weight and --priority, then set what you
    chose (throttle set; a weight or a priority in the code). With nothing proposed, the replay says how close its model is to what
    happened (a model: no slack, no leases, costs as estimated at the check).
    """
    ctl = _controller(ctx)
    try:
        proposal = simulation.Proposal.parse(rates, slots, fifo, weights, priorities)
    except (ValueError, ThrottleError) as exc:
        raise click.BadParameter(str(exc), param_hint="--rate/--concurrency/--weight/--priority") from None
    if path is not None:
        with open(path, encoding="utf-8") as f:
            events = [line for line in f if line.strip()]
    else:
        until_ms = ctl.store.now_us() // 1000
        seconds = show.duration(since) or 600.0
        events = ctl.store.recorded(until_ms - int(seconds * 1000), until_ms)
        if not events and not ctl.settings.record:
            raise click.ClickException("nothing is recorded: set throttle_record (e.g. 100000 events) on the workers "
                                       "and producers, let traffic come, then simulate")
    if export is not None:
        with open(export, "w", encoding="utf-8") as f:
            f.writelines(e.rstrip("\n") + "\n" for e in events)
        click.echo(f"{len(events)} event(s) written to {export}")
        return
    tasks, orphans = simulation.tasks_of(events)
    outcomes = simulation.replay(tasks, proposal)
    if as_json:
        click.echo(json.dumps({"keys": [show.simulated_dict(o) for o in outcomes], "tasks": len(tasks),
                               "events_before_the_span": orphans}, indent=2))
        return
    if not outcomes:
        click.echo("no task in the record of that span")
        return
    show.simulated_table(outcomes)
    if orphans:
        click.echo(f"{orphans} event(s) of tasks that arrived before the span were left out")


@throttle.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check the store: can it evict or lose the tasks waiting in its lines, and its counts?
    Exit 1 if so."""
    ctl = _controller(ctx)
    report = ctl.store.report(ctl.lines.journal.enabled)
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
        click.echo(json.dumps(show.whereabouts_dict(found), indent=2))
        return
    for line in show.whereabouts_lines(found):
        click.echo(line)


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
        if not (yes or click.confirm(f"forget what every key of {show.scope_and_key(scope, None)} counted?")):
            raise click.Abort()
        keys = ctl.reset_keys(scope)
        click.echo(f"reset {show.scope_and_key(scope, None)}: {len(keys)} window(s)" if keys
                   else f"{show.scope_and_key(scope, None)}: nothing to reset")
        return
    if not (yes or click.confirm(f"forget what {show.scope_and_key(scope, key)} counted?")):
        raise click.Abort()
    found = ctl.reset(scope, key=key)
    if found:
        click.echo(f"reset {show.scope_and_key(scope, key)}")
        return
    keyed = [st for st in ctl.statuses(scope=scope, limit=2)[0] if st.key is not None] if key is None else []
    click.echo(f"{show.scope_and_key(scope, key)}: nothing to reset"
               + (" (its keys have windows of their own: --key KEY, or --all-keys)" if keyed else ""))


throttle.add_command(parked)
