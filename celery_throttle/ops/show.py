"""How ``celery -A proj throttle ...`` shows what it found: the status table, the JSON
documents, where a task waits (``why``), times and durations as people on call read
them. User data (scopes, keys, task ids) is shown as it is, with control characters
escaped, and never read as markup.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import click
from kombu.exceptions import ContentDisallowed, DecodeError

from ..celery_parts.messages import decode_message
from .simulate import waits

__all__ = ["UNITS", "WHERE", "as_dict", "by_window", "clock", "duration", "empty", "escaped", "from_now", "in_force",
           "iso", "mark", "nothing_matched", "pause_end", "pause_fields", "scope_and_key", "slots_cell",
           "status_table", "task_name", "waiting_cell", "when", "whereabouts_dict", "whereabouts_lines"]


def nothing_matched(match: str, key_match: str | None) -> str:
    line = f"nothing matched --match {match!r}" + ("" if key_match is None else f" --key-match {key_match!r}")
    line += " (--match selects scopes, --key-match keys"
    if key_match is None and ":" in match:
        scope_glob, _, key_glob = match.partition(":")
        line += f": a key of a scope is --match {scope_glob!r} --key-match {key_glob!r}"
    return line + ")"


def empty(status: Any) -> bool:
    """Nothing counted, paused, limited, running or waiting."""
    return not (status.rates or status.paused_until is not None or status.live_limit or status.live_concurrency
                or status.running or status.waiting or status.shadow)


def scope_and_key(scope: str, key: str | None) -> str:
    """A scope and key as the CLI names them (quoted: user data, printed as it is)."""
    return f"scope {scope!r}" + ("" if key is None else f" key {key!r}")


def slots_cell(status: Any) -> str:
    """The slots cell of a row: "2/4" (held of the limit; "(live)" when a live limit sets it);
    a key of a shared scope, "2/3 of 8" (held of its cap, of the scope's K)."""
    if not (status.concurrency or status.running):
        return ""
    live = " (live)" if status.live_concurrency else ""
    if status.share_cap is not None:
        return f"{status.running}/{status.share_cap} of {status.concurrency or '?'}{live}"
    return f"{status.running}/{status.concurrency or '?'}{live}"


def waiting_cell(status: Any) -> str:
    """The waiting cell of a row: tasks in the line, and "+n out" released and not started."""
    if not (status.waiting or status.released):
        return ""
    return str(status.waiting) + (f" +{status.released} out" if status.released else "")


def as_dict(status: Any) -> dict[str, Any]:
    return {
        "scope": status.scope, "key": status.key,
        **pause_fields(status.paused_until),
        "live_limit": [str(r) for r in status.live_limit] if status.live_limit else None,
        "waiting": status.waiting, "released": status.released,
        "running": status.running, "concurrency": status.concurrency,
        "live_replaces_all": status.live_replaces_all,
        "live_concurrency": status.live_concurrency, "share_cap": status.share_cap,
        "adaptive": adaptive_dict(status.adaptive),
        "mode": status.mode,
        "shadow": None if status.shadow is None else {
            "checked": status.shadow.checked, "held": status.shadow.held,
            "waited_seconds": round(status.shadow.waited, 3), "longest_seconds": round(status.shadow.longest, 3)},
        "rates": [{"rate": str(r.rate), "algorithm": r.algorithm, "used": r.used, "remaining": r.remaining,
                   "reset_at": iso(r.reset_at)} for r in status.rates],
    }


def status_table(found: list[Any], more: bool, dead: int, listing: bool) -> None:
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
            "until resumed" if s.paused_until == float("inf") else f"until {clock(s.paused_until)}")
        live = set(s.live_limit or ())
        # A row per stored rate, marked when a live limit sets it (or, set with --replace,
        # lifts it); a scope with only a control (a pause, a live limit) gets one row for it.
        rows = [(f"{r.rate}{mark(r.rate, live, s.live_replaces_all)}{adaptive_mark(s.adaptive)}", str(r.used),
                 str(r.remaining),
                 clock(r.reset_at))
                for r in s.rates] or [(", ".join(f"{r} (live)" for r in sorted(live)) or "-", "", "", "")]
        for i, (rate, used, left, resets) in enumerate(rows):
            first = i == 0
            # Scopes and keys are user data: Text, never read as rich markup ("[red]acme").
            cells = [Text(escaped(s.scope)) if first else "", Text("-" if s.key is None else escaped(s.key)) if first else "",
                     *([rate, used, left, resets] if counted else []),
                     *([waiting_cell(s) if first else ""] if waiting else []),
                     *([slots_cell(s) if first else ""] if slots else []), *([paused if first else ""] if paused_any else [])]
            table.add_row(*cells)
    console = Console(width=None if Console().is_terminal else 80, soft_wrap=False)
    if found:
        console.print(table)
    if more:
        click.echo("... more not shown (narrow with --match, or raise --limit)")
    if waiting:
        click.echo("waiting: tasks in the key's line, waiting for room (+ released to a worker, not started yet)")
    if slots:
        click.echo("slots: concurrency slots held (bodies running) of the limit"
                   + ("; 'of K': of the key's cap in its scope's share of K" if any(
                       s.share_cap is not None for s in found) else ""))
    for s in found:
        if s.mode == "shadow" or s.shadow is not None:
            click.echo(shadow_line(s))
    if listing and dead:
        click.echo(f"dead letters: {dead} (tasks whose message could not be sent: throttle parked --dead)")


def in_force(ctl: Any, scope: str, key: str | None, live: set[Any]) -> str:
    """The line that says which rates are in force after a live limit: each one, live or
    declared, and the declared ones it lifted."""
    declared, by_callable = ctl.declared_rates(scope)
    rates = ctl.rates_in_force(scope, key)
    line = "in force: " + ", ".join(f"{r} ({'live' if r in live else 'declared'})" for r in sorted(rates, key=by_window))
    windows = {(r.period_us, r.unit) for r in live}
    lifted = sorted((r for r in declared if r not in rates and (r.period_us, r.unit) not in windows), key=by_window)
    if lifted:
        line += f"; lifted until `throttle unset`: {', '.join(map(str, lifted))}"
    if by_callable:
        line += "; and the rates of other windows that a task's rate callable returns, per call"
    elif not declared:
        line += " (no task of this app declares rates for it)"
    return line


def by_window(rate: Any) -> tuple[int, str, int]:
    """Rates as people read them: the shortest window first."""
    return rate.period_us, rate.unit, rate.limit


WHERE = {
    "line": "waiting in the line of {target}",
    "released": "released from the line of {target}, on its way to a worker",
    "dead": "a dead letter since {until}: its message could not be sent (throttle parked --dead)",
    "countdown": "held by worker {worker} as a countdown until {until}",
    "received": "received by worker {worker}, waiting for a pool process",
    "running": "running on worker {worker}",
}


def whereabouts_lines(found: Any) -> list[str]:
    head = f"task {found.task_id}" + (f" ({found.name})" if found.name else "")
    if found.where == "unknown":
        return [(f"{head}: not waiting in the throttle: it is not parked, and none of the {found.workers_asked} "
                "worker(s) that answered holds it (it may be in a queue no worker has taken it from yet, done, "
                "or unknown)")]
    until = "?" if found.until is None else f"{when(found.until)} ({from_now(found.until)})"
    target = scope_and_key(found.scope or "?", found.key)
    lines = [f"{head}: {WHERE[found.where].format(until=until, worker=found.worker, target=target)}"]
    if found.where == "line":
        estimate = "" if found.start is None else (f"; it may start about {when(found.start)} "
                                                   f"({from_now(found.start)})")
        lines.append(f"{target}: place {found.place} of {found.waiting} waiting{estimate}")
    elif found.scope is not None and found.where != "released":
        lines.append(target)
    if found.paused_until is not None:
        lines.append("held by: a pause " + pause_end(found.paused_until))
    elif found.share_cap is not None and found.running is not None and found.running >= found.share_cap:
        lines.append(f"held by: its share of the scope's {found.concurrency} slots ({found.running} held of its cap "
                     f"{found.share_cap}); the sharer raises the cap as other keys of the scope give slots back")
    elif found.concurrency and found.running is not None and found.running >= found.concurrency:
        lines.append(f"held by: its concurrency limit ({found.running} of {found.concurrency} slots held); the next "
                     "slot to free goes to the head of the line")
    elif found.fullest is not None and found.where in ("line", "countdown", "received"):
        r = found.fullest
        lines.append(f"held by: the rate {r.rate} ({r.used} used, {r.remaining} left now, resets "
                     f"{when(r.reset_at)})")
    if found.adaptive is not None:
        lines.append(adaptive_line(found.adaptive))
    return lines


def shadow_line(status: Any) -> str:
    """What a throttle in shadow mode would have held back of a scope and key."""
    head = scope_and_key(status.scope, status.key) + (
        f" is in {status.mode} mode" if status.mode else " (its mode: no task of this app uses the scope)")
    seen = status.shadow
    if seen is None:
        return head + ": nothing checked in shadow mode lately"
    held = f"{seen.held} of the {seen.checked} starts checked in shadow mode would have been held back"
    if seen.held:
        held += f", {seen.waited / seen.held:.1f}s on average, {seen.longest:.1f}s at most"
    return f"{head}: {held}"


def adaptive_mark(level: Any) -> str:
    """A rate cell's mark for an adaptive throttle below its ceiling: " (adapt 35%)"."""
    return "" if level is None or level.share >= 1.0 else f" (adapt {100 * level.share:.0f}%)"


def adaptive_line(level: Any) -> str:
    """Where an adaptive throttle stands, and why it moved."""
    if level.pushback is None:
        return "adaptive: at its declared rates (no pushback from its downstream lately)"
    return (f"adaptive: at {100 * level.share:.0f}% of its declared rates; its downstream pushed back "
            f"({level.pushback.reason}) {level.ago:.1f}s ago, at {100 * level.pushback.w_max:.0f}%, and it "
            "rises again while none comes")


def adaptive_dict(level: Any) -> dict[str, Any] | None:
    if level is None:
        return None
    pushed = level.pushback
    return {"share": round(level.share, 4),
            "last_pushback": None if pushed is None else {"at": iso(pushed.at_us / 1e6), "share": pushed.w_max,
                                                          "reason": pushed.reason}}


def whereabouts_dict(found: Any) -> dict[str, Any]:
    r = found.fullest
    return {
        "task_id": found.task_id, "where": found.where, "name": found.name, "scope": found.scope, "key": found.key,
        "until": None if found.until is None else iso(found.until),
        "estimated_start": None if found.start is None else iso(found.start), "worker": found.worker,
        **pause_fields(found.paused_until),
        "adaptive": adaptive_dict(found.adaptive),
        "fullest_rate": None if r is None else {"rate": str(r.rate), "used": r.used, "remaining": r.remaining,
                                                "reset_at": iso(r.reset_at)},
        "line": None if found.where != "line" else {"place": found.place, "waiting": found.waiting,
                                                    "running": found.running, "concurrency": found.concurrency},
    }


def pause_fields(paused_until: float | None) -> dict[str, Any]:
    """A pause in JSON: whether there is one, its end (an ISO time, or null: none, or
    open-ended) and whether it lasts until resumed, so that every time field is a time or null."""
    open_ended = paused_until == float("inf")
    return {"paused": paused_until is not None,
            "paused_until": None if paused_until is None or open_ended else iso(paused_until),
            "paused_until_resumed": open_ended}


def from_now(timestamp: float) -> str:
    seconds = timestamp - dt.datetime.now().timestamp()
    return f"in {seconds:.1f}s" if seconds >= 0 else f"{-seconds:.1f}s ago"


def escaped(text: str) -> str:
    """User data as it is, with its control characters escaped (a newline or an escape
    sequence in an id never reaches the terminal raw)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def task_name(app: Any, message: bytes | None) -> str:
    if message is None:
        return "<message gone>"
    try:
        return str(decode_message(app, message).get("task"))
    except (ValueError, TypeError, AttributeError, DecodeError, ContentDisallowed):
        return "<cannot be decoded>"  # the reason it is a dead letter, often


def when(timestamp: float) -> str:
    """A time as people on call read it: local, with its zone."""
    return dt.datetime.fromtimestamp(timestamp).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def mark(rate: Any, live: set[Any], replaces_all: bool) -> str:
    if rate in live:
        return " (live)"
    return " (not in force)" if replaces_all else ""


def iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="milliseconds")


def clock(timestamp: float) -> str:
    """A time in a table: the clock only when it is today."""
    moment = dt.datetime.fromtimestamp(timestamp).astimezone()
    today = dt.datetime.now().astimezone().date()
    return moment.strftime("%H:%M:%S" if moment.date() == today else "%Y-%m-%d %H:%M:%S")


def pause_end(timestamp: float) -> str:
    return "until resumed" if timestamp == float("inf") else f"until {when(timestamp)}"


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str | None) -> float | None:
    """90s, 5m, 2h, 1d, or a number of seconds; None stays None."""
    if text is None:
        return None
    value, unit = text.strip(), "s"
    if value[-1:].lower() in UNITS:
        value, unit = value[:-1], value[-1].lower()
    try:
        seconds = float(value) * UNITS[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r}: use e.g. 90s, 5m, 2h, 1d", param_hint="--for") from None
    if not seconds > 0:
        raise click.BadParameter(f"{text!r}: must be more than 0", param_hint="--for")
    return seconds


def simulated_dict(outcome: Any) -> dict[str, Any]:
    return {"scope": outcome.scope, "key": outcome.key, "tasks": len(outcome.did),
            "rates": [str(r) for r in outcome.rates], "concurrency": outcome.concurrency or None,
            "waited": waits(outcome.did), "would_wait": waits(outcome.would)}


def simulated_table(outcomes: list[Any]) -> None:
    """Each key's waits, as they were and as they would have been (p50 / p95 / most)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in (("scope", "left"), ("key", "left"), ("tasks", "right"), ("under", "left"),
                          ("waited p50/p95/max", "right"), ("would wait", "right")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for o in outcomes:
        d = simulated_dict(o)
        under = ", ".join(d["rates"]) + (f", K={o.concurrency}" if o.concurrency else "")
        table.add_row(Text(escaped(o.scope)), Text("-" if o.key is None else escaped(o.key)), str(d["tasks"]),
                      under or "-", _waits_cell(d["waited"]), _waits_cell(d["would_wait"]))
    Console(width=None if Console().is_terminal else 100, soft_wrap=False).print(table)
    click.echo("waits in seconds; 'under': the limits replayed (proposed, else as recorded); "
               "?: not started in the span (waited), or its cost never fits (would wait)")


def _waits_cell(w: dict[str, Any]) -> str:
    if w["p50"] is None:
        return "?" * max(w["unknown"], 1)
    cell = f"{w['p50']:.2f} / {w['p95']:.2f} / {w['max']:.2f}"
    return cell + (f" (+{w['unknown']} ?)" if w["unknown"] else "")
