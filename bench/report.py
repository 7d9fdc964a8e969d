"""Printing the results (rich) and writing them as Markdown and JSON."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import MET, MISSED, Results


def _order(res: Results) -> list[Any]:
    """Rows by section number (sections run in another order), stable within one."""
    def key(row: Any) -> int:
        head = row.section.split()[0].split("-")[0]
        return int(head) if head.isdigit() else 99
    return sorted(res.rows, key=key)


def print_table(res: Results, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for col, style in (("Section", "cyan"), ("Metric", ""), ("Variant", "bold"), ("Value", ""),
                       ("Target", ""), ("Status", ""), ("Note", "dim")):
        table.add_column(col, style=style or None, overflow="fold")
    last = None
    for r in _order(res):
        status = {MET: "[green]met[/]", MISSED: "[bold red]MISSED[/]"}.get(r.status, "")
        table.add_row(r.section if r.section != last else "", r.metric, r.variant, r.value, r.target,
                      status, r.note)
        last = r.section
    console = Console(width=max(Console().width, 170))
    console.print(table)
    for block in res.tables:
        console.print("\n" + block + "\n", highlight=False, markup=False, soft_wrap=True)
    for note in res.notes:
        console.print(f"- {note}", highlight=False, markup=False)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(res: Results, meta: dict[str, Any]) -> str:
    lines = ["# celery_throttle benchmark results", ""]
    lines.append(f"Command: `{meta['command']}` — {meta['when']}, took {meta['elapsed_s']:.0f} s.  ")
    lines.append(f"Machine: {meta['machine']}.  ")
    if meta.get("commit"):
        lines.append(f"celery_throttle at commit {meta['commit']}.  ")
    lines.append("Workers: 2 Celery workers x 2 prefork processes, Redis broker and store on the "
                 "same local Redis; start times are the task bodies' own clock.")
    lines.append("")
    lines.append("| Section | Metric | Variant | Value | Target | Status | Note |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in _order(res):
        status = {MET: "met", MISSED: "**missed**"}.get(r.status, "")
        lines.append("| " + " | ".join(_cell(x) for x in (r.section, r.metric, r.variant, r.value,
                                                           r.target, status, r.note)) + " |")
    for block in res.tables:
        lines += ["", block]
    if res.notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {n}" for n in res.notes]
    met = sum(r.status == MET for r in res.rows)
    missed = sum(r.status == MISSED for r in res.rows)
    lines += ["", f"Targets: {met} met, {missed} missed.", ""]
    return "\n".join(lines)


def write(res: Results, meta: dict[str, Any], paths: list[Path]) -> None:
    text = to_markdown(res, meta)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_json(res: Results, meta: dict[str, Any], path: Path) -> None:
    data = {"meta": meta, "rows": [asdict(r) for r in res.rows], "notes": res.notes, "tables": res.tables,
            "series": {k: v for k, v in res.series.items() if k != "long_wait"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def commit() -> str:
    """The checked-out commit, with "+changes" when the work tree differs from it."""
    import subprocess

    from bench.common import ROOT

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "celery_throttle"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + (" + uncommitted changes in celery_throttle/" if dirty else "")


def machine() -> str:
    import os

    import celery
    import redis

    from bench.common import store_client

    try:
        server = store_client().info("server").get("redis_version", "?")
    except Exception:
        server = "?"
    return (f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, Celery {celery.__version__}, "
            f"redis-py {redis.__version__}, Redis {server}")
