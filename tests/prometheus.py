"""Prometheus for the monitoring tests: Debian's ``prometheus`` and ``promtool`` binaries
(``apt-get install prometheus``; `.ci/run` installs them when it can), a server of a test's
own on a free loopback port, and what the dashboard and the rules in ``monitoring/`` hold.

Used by ``tests/pure/test_monitoring.py`` and by ``monitoring/screenshot.py``.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, free_port, wait_for

MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "celery_throttle.json"
ALERTS = MONITORING / "prometheus" / "alerts.yml"
ALERTS_TEST = MONITORING / "prometheus" / "alerts_test.yml"

#: What Grafana puts in place of its variables when "All" is chosen, and of its intervals
#: (as for a scrape every 15 s): the dashboard's expressions as Prometheus is asked them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$job": ".*", "$scope": ".*"}


def binary(name: str) -> str | None:
    """The path of ``prometheus`` or ``promtool``, or None if it is not installed."""
    return shutil.which(name)


def exported_metrics() -> frozenset[str]:
    """The names the package's metrics are exported under, read from the source of
    ``celery_throttle/check/metrics.py`` (each ``_instrument(KIND, NAME, ...)``): a counter's
    name with ``_total``, a gauge's as it is."""
    tree = ast.parse((ROOT / "celery_throttle" / "check" / "metrics.py").read_text("utf-8"))
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_instrument"
                and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2])):
            kind, name = node.args[0].value, node.args[1].value
            names.add(f"{name}_total" if kind == "Counter" else name)
    return frozenset(names)


def metrics_named(expr: str) -> set[str]:
    """The package's metric names an expression (or a rules file) uses."""
    return set(re.findall(r"\bcelery_throttle_[a-z_]+\b", expr))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text("utf-8"))


def panel_queries(board: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Every (panel title, expression) of the dashboard, its Grafana variables replaced
    (:data:`GRAFANA_VARIABLES`)."""
    queries = []
    for panel in (board or dashboard())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
                expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
            queries.append((panel["title"], expr))
    return queries


class PrometheusServer:
    """Debian's ``prometheus`` on a free loopback port, with a data folder of its own,
    scraping ``targets`` (job name -> ``host:port`` list) every ``interval`` and evaluating
    ``rule_files`` as often."""

    def __init__(self, targets: dict[str, list[str]], rule_files: list[Path], interval: str = "1s") -> None:
        path = binary("prometheus")
        if path is None:
            raise RuntimeError("prometheus is not installed (Debian: apt-get install prometheus)")
        self.binary = path
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ct-prometheus-"))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(f) for f in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in targets.items()],
        }
        # (JSON is YAML: no YAML library needed)
        (self.dir / "prometheus.yml").write_text(json.dumps(config, indent=2))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        with open(self.dir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.dir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 60, 0.2, f"prometheus on {self.port}")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        path = self.dir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params: Any) -> Any:
        """``/api/v1/PATH`` with ``params``: its ``data``, or an AssertionError with the
        error Prometheus gave (a query that does not parse is one)."""
        url = f"{self.url}/api/v1/{path}"
        data = urllib.parse.urlencode(params).encode() if params else None
        try:
            with urllib.request.urlopen(url, data=data, timeout=30) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"prometheus refused {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (a vector), now."""
        return self.api("query", query=expr, time=f"{time.time():.3f}")["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now."""
        return self.api("alerts")["alerts"]

    def targets_up(self) -> dict[str, bool]:
        return {t["scrapeUrl"]: t["health"] == "up" for t in self.api("targets")["activeTargets"]}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
