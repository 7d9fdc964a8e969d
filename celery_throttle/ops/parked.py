"""``celery -A proj throttle parked``: the tasks waiting in the lines, by scope and key, an
operator's purge and send-now, and the dead letters."""

from __future__ import annotations

from typing import Any

import click

from ..celery_parts.messages import resend
from ..check.controller import controller
from ..core.keys import target_matches
from . import show

__all__ = ["parked"]


@click.command()
@click.option("--tasks", is_flag=True, help="List each waiting task (id, task, scope, key, place) instead of a summary.")
@click.option("--match", default="*", show_default=True, help="Only tasks whose scope matches this glob.")
@click.option("--key-match", default=None, metavar="GLOB", help="Only tasks whose key matches this glob.")
@click.option("--purge", is_flag=True, help="Delete the waiting tasks (those --match selects); asks first.")
@click.option("--send-now", is_flag=True,
              help="Send the waiting tasks (every task of each key --match selects) to their queues now, whatever "
                   "their keys' room: before rolling back to a version without lines. Asks first.")
@click.option("--dead", is_flag=True, help="List the dead letters: tasks whose message could not be sent.")
@click.option("--requeue", is_flag=True, help="Send every dead letter to its queue again, now, as a new task (asks first).")
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
    ctl = controller(ctx.obj.app)
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
            click.echo(f"{show.escaped(w.task_id)}  {w.name}  {show.scope_and_key(w.scope, w.key)}  {where}  since {show.when(w.since)}")
    else:
        groups: dict[tuple[str, str | None], list[Any]] = {}
        for w in found:
            groups.setdefault((w.scope, w.key), []).append(w)
        for (scope, key), listed in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or "")):
            lined = [w for w in listed if w.place]
            oldest = min((w.since for w in listed), default=0.0)
            click.echo(f"{show.scope_and_key(scope, key)}: {len(lined)} waiting, {len(listed) - len(lined)} released, "
                       f"the oldest since {show.when(oldest)}")
    if not found:
        click.echo("no task waits in a line")
    dead_count = ctl.store.dead_count()
    if dead_count:
        click.echo(f"dead letters: {dead_count} (throttle parked --dead)")


def _dead_letters(ctl: Any, requeue: bool, drop: bool, yes: bool) -> None:
    letters = ctl.store.dead_letters()
    for letter_id, since_us, message in letters:
        click.echo(f"{show.escaped(letter_id)}  {show.task_name(ctl.app, message)}  dead since {show.when(since_us / 1e6)}")
    ids = [letter_id for letter_id, _, _ in letters]
    if requeue and ids and (yes or click.confirm(f"send {len(ids)} dead letter(s) to run again?")):
        sent = []
        for letter_id, _, message in letters:
            try:
                # (As a new task: the worker that gets it checks it, behind its key's line.)
                resend(ctl.app, message or b"")
            except Exception as exc:  # noqa: BLE001 - one that still cannot be sent stays, the others go
                click.echo(f"{show.escaped(letter_id)}: still cannot be sent ({exc}); kept")
                continue
            sent.append(letter_id)
        ctl.store.drop_dead(sent)
        click.echo(f"requeued {len(sent)} dead letter(s)")
    elif drop and ids and (yes or click.confirm(f"delete {len(ids)} dead letter(s) for good?")):
        click.echo(f"dropped {ctl.store.drop_dead(ids)} dead letter(s)")
    if not letters:
        click.echo("no dead letters")
