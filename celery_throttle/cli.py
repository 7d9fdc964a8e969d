"""``celery -A proj throttle ...``: inspect and reset limits, see parked tasks.

Registered under the ``celery.commands`` entry point group, as Flower does.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import click

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
@click.pass_context
def parked(ctx: click.Context) -> None:
    """Count tasks parked in Redis for a long wait."""
    waiting, in_flight = _controller(ctx).store.parked_count()
    click.echo(f"parked: {waiting} waiting, {in_flight} being released")
