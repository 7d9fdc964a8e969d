"""Draw the dashboard's panels from a real run: docs/dashboard.png.

Grafana is not in Debian's repositories, so this does not show Grafana: it runs a real
worker (tests.taskapp, 2 prefork processes, its metrics served in prometheus-client's
multiprocess mode) and a second worker whose store does not answer, scraped every second
by Debian's Prometheus with monitoring/prometheus/alerts.yml loaded; a producer sends
bursts over the limits for a few minutes; then each panel of
monitoring/grafana/celery_throttle.json is drawn where its gridPos puts it, from
Prometheus's query_range API for its own expressions (rates over 30 s; stat panels: the
last value, or the whole run for ``$__range``), with the alerts active at the end.

From a checkout, with Redis at 127.0.0.1:6379 (database 9, keys under a prefix of its own,
deleted after), Debian's prometheus package, and matplotlib (the bench extra)::

    python -m monitoring.screenshot [--minutes 4] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import redis

from tests.helpers import ROOT, WorkerGroup, free_port
from tests.prometheus import ALERTS, PrometheusServer, dashboard

REDIS_URL = "redis://127.0.0.1:6379/9"
RATE_INTERVAL = "30s"
STEP = 2.0


def setup(tmp: Path) -> tuple[PrometheusServer, WorkerGroup, WorkerGroup]:
    """A worker scraped with its metrics in multiprocess mode, a worker whose store does not
    answer, and Prometheus (not started yet)."""
    prefix = f"ct-shot-{uuid.uuid4().hex[:8]}"
    live_port, dead_port = free_port(), free_port()
    (tmp / "live").mkdir()
    (tmp / "dead").mkdir()
    live = WorkerGroup(prefix, REDIS_URL, REDIS_URL, count=1, concurrency=2, records=REDIS_URL,
                       env={"CT_BACKEND": REDIS_URL, "CT_METRICS_PORT": str(live_port),
                            "PROMETHEUS_MULTIPROC_DIR": str(tmp / "live")})
    dead = WorkerGroup(f"{prefix}-dead", REDIS_URL, f"redis://127.0.0.1:{free_port()}/0", count=1, concurrency=1,
                       records=REDIS_URL,
                       env={"CT_BACKEND": REDIS_URL, "CT_METRICS_PORT": str(dead_port),
                            "PROMETHEUS_MULTIPROC_DIR": str(tmp / "dead")})
    prometheus = PrometheusServer({"celery-workers": [f"127.0.0.1:{live_port}"],
                                   "celery-store-down": [f"127.0.0.1:{dead_port}"]}, [ALERTS])
    return prometheus, live, dead


def load(live: WorkerGroup, dead: WorkerGroup, minutes: float) -> tuple[float, float]:
    """Bursts over each limit every 25 s (from a producer that imports the tasks and sends,
    unchecked at publish: the worker is what is scraped), and 2 tasks to the worker whose
    store does not answer; returns the run's start and end."""
    start = time.time()
    time.sleep(20)  # (a quiet start: the panels' lines rise from zero)
    for _ in range(2):
        dead.send("below", "shot")
    wave = 0
    while time.time() < start + minutes * 60 - 25:
        wave += 1
        label = f"shot-{wave}"
        # 5/s; 2 slots (bodies of 1 s); 2/m with max_wait 5 s (a tenant every 3 bursts); 3/4s (16 s of line)
        live.produce({"how": "delay", "task": "below", "args": [label], "count": 20 + 10 * (wave % 3)},
                     {"how": "delay", "task": "exporting", "args": [label, "acme", 1.0], "count": 6},
                     {"how": "delay", "task": "capped", "args": [label, f"t{wave // 3}"], "count": 3},
                     {"how": "delay", "task": "slow_quota", "args": [label, "t1"], "count": 12},
                     CT_CHECK_AT_PUBLISH="0", CT_METRICS_PORT="", PROMETHEUS_MULTIPROC_DIR="")
        time.sleep(max(0.0, start + 20 + wave * 25 - time.time()))
    return start, time.time()


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template) or "value"


def _expr(expr: str, span: float) -> str:
    values = {"$__rate_interval": RATE_INTERVAL, "$__range": f"{math.ceil(span)}s", "$job": ".*", "$scope": ".*"}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def _shown(value: float, unit: str, decimals: int | None) -> str:
    """A stat as the panel's unit and decimals show it."""
    number = f"{value:.{1 if decimals is None else decimals}f}"
    if decimals is None and unit == "short" and abs(value - round(value)) < 0.05:
        number = f"{value:.0f}"
    return {"ops": f"{number}/s", "s": f"{number} s"}.get(unit, number)


def draw(prometheus: PrometheusServer, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    board = dashboard()
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    width, unit_h, head = 13.0, 0.27, 0.85  # inches: the figure, a grid row, the heading
    height = rows * unit_h + head
    fig = plt.figure(figsize=(width, height), dpi=90)
    alerts = sorted(prometheus.alerts(), key=lambda a: a["labels"]["alertname"])
    when = datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.text(0.01, 1 - 0.22 / height, f"{board['title']} — monitoring/grafana/celery_throttle.json, drawn from "
             f"Prometheus by monitoring/screenshot.py (not Grafana)", fontsize=12, weight="bold", va="top")
    shown_alerts = "; ".join(
        f"{a['labels']['alertname']} {a['state']} ({a['labels'].get('instance') or a['labels'].get('scope', '')})"
        for a in alerts) or "none"
    fig.text(0.01, 1 - 0.42 / height, f"A real run, {when}, {(end - start) / 60:.0f} min: 1 worker (2 prefork "
             f"processes) under bursts over its limits every 25 s, 1 worker whose store does not answer; scraped "
             f"every 1 s, rates over {RATE_INTERVAL}.\nAlerts at the end: {shown_alerts}", fontsize=8, va="top",
             color="#333333", linespacing=1.4)
    times_fmt = mdates.DateFormatter("%H:%M", tz=timezone.utc)
    for panel in board["panels"]:
        g = panel["gridPos"]
        # (its cell in inches, less room for the title above and the axis' labels around)
        x0, top = g["x"] / 24 * width, head + g["y"] * unit_h
        w, h = g["w"] / 24 * width, g["h"] * unit_h
        ax = fig.add_axes(((x0 + 0.45) / width, 1 - (top + h - 0.3) / height,
                           (w - 0.6) / width, (h - 0.62) / height))
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        ax.set_title(panel["title"], fontsize=9, loc="left", weight="bold")
        if panel["type"] == "stat":
            target = panel["targets"][0]
            result = prometheus.api("query", query=_expr(target["expr"], end - start), time=f"{end:.3f}")["result"]
            value = float(result[0]["value"][1]) if result else float("nan")
            defaults = panel["fieldConfig"]["defaults"]
            steps = defaults.get("thresholds", {}).get("steps", [])
            red = next((s["value"] for s in steps if s["color"] == "red"), None)
            color = "#c4162a" if red is not None and value >= red else ("#37872d" if red is not None else "#1f60c4")
            shown = "no data" if math.isnan(value) else _shown(value, unit, defaults.get("decimals"))
            ax.text(0.5, 0.42, shown, fontsize=20, color=color,
                    ha="center", va="center", weight="bold", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for target in panel["targets"]:
            for series in prometheus.query_range(_expr(target["expr"], end - start), start, end, STEP):
                xs = [datetime.fromtimestamp(float(t), timezone.utc) for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.2, label=_legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_xlim(datetime.fromtimestamp(start, timezone.utc), datetime.fromtimestamp(end, timezone.utc))
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(mdates.MinuteLocator(tz=timezone.utc))
        ax.xaxis.set_major_formatter(times_fmt)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if unit == "ops":
            ax.set_ylabel("/s", fontsize=7)
        elif unit == "s":
            ax.set_ylabel("s", fontsize=7)
        if ax.lines:
            ax.legend(fontsize=6.5, loc="upper left", frameon=False, ncol=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    options = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ct-shot-") as tmp:
        prometheus, live, dead = setup(Path(tmp))
        try:
            prometheus.start()
            live.start()
            dead.start()
            start, end = load(live, dead, options.minutes)
            draw(prometheus, start, end, options.out)
        finally:
            live.stop()
            dead.stop()
            prometheus.stop()
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{live.prefix}*", count=1000):
                client.delete(key)
            client.close()
    print(f"wrote {options.out} ({options.out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
