"""``celery -A proj throttle ...``: inspect and reset limits, see parked tasks.

Registered under the ``celery.commands`` entry point group, as Flower does.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import click
from kombu.exceptions import ContentDisallowed, DecodeError

from .errors import ThrottleError

__all__ = ["throttle"]


def _controller(ctx: click.Context) -> Any:
    from . import install

    return install(ctx.obj.app)


class _Group(click.Group):
    """Says what went wrong in one line (Redis unreachable, a bad setting), no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ThrottleError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(name="throttle", cls=_Group)
def throttle() -> None:
    """Global rate limits (celery_throttle)."""


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="The key (e.g. tenant id) within the scope.")
@click.pass_context
def status(ctx: click.Context, scope: str, key: str | None) -> None:
    """Show usage of SCOPE (and KEY) per rate, consuming nothing."""
    result = _controller(ctx).status(scope, key=key)
    if not result.rates:
        click.echo(f"{scope} key={key}: nothing counted")
        return
    for r in result.rates:
        reset = dt.datetime.fromtimestamp(r.reset_at).isoformat(timespec="seconds")
        click.echo(f"{scope} key={key} {r.algorithm} {r.rate}: used {r.used}, "
                   f"remaining {r.remaining}, clear at {reset}")


@throttle.command()
@click.argument("scope")
@click.option("--key", default=None, help="The key (e.g. tenant id) within the scope.")
@click.pass_context
def reset(ctx: click.Context, scope: str, key: str | None) -> None:
    """Forget every window of SCOPE (and KEY)."""
    found = _controller(ctx).reset(scope, key=key)
    click.echo(f"reset {scope} key={key}" if found else f"{scope} key={key}: nothing to reset")


@throttle.command()
@click.option("--dead", is_flag=True, help="List the dead letters: parked tasks that could not be sent back.")
@click.option("--requeue", is_flag=True, help="Hand every dead letter out again, now.")
@click.option("--drop", is_flag=True, help="Delete every dead letter (asks first).")
@click.option("--yes", is_flag=True, help="Do not ask before --drop.")
@click.pass_context
def parked(ctx: click.Context, dead: bool, requeue: bool, drop: bool, yes: bool) -> None:
    """Count tasks parked in Redis for a long wait, and deal with dead letters."""
    ctl = _controller(ctx)
    store = ctl.store
    if dead or requeue or drop:
        letters = store.dead_letters()
        for parked_id, when_us, attempts, message in letters:
            click.echo(f"{parked_id}  {_task_name(ctl.app, message)}  dead since "
                       f"{_when(when_us / 1e6)} after {attempts} attempts")
        ids = [parked_id for parked_id, _, _, _ in letters]
        if requeue:
            click.echo(f"requeued {store.requeue_dead(ids)} dead letter(s)")
        elif drop and ids and (yes or click.confirm(f"delete {len(ids)} dead letter(s) for good?")):
            click.echo(f"dropped {store.drop_dead(ids)} dead letter(s)")
        if not letters:
            click.echo("no dead letters")
        return
    waiting, in_flight, dead_count = store.parked_count()
    click.echo(f"parked: {waiting} waiting, {in_flight} being released, {dead_count} dead")


def _task_name(app: Any, message: bytes | None) -> str:
    from .parking import decode_message

    if message is None:
        return "<message gone>"
    try:
        return str(decode_message(app, message).get("task"))
    except (ValueError, TypeError, AttributeError, DecodeError, ContentDisallowed):
        return "<cannot be decoded>"  # the reason it is a dead letter, often


def _when(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")
