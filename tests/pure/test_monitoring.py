"""The dashboard and the alert rules that ship in ``monitoring/``: the rules pass promtool and
their unit tests, the dashboard's expressions parse and name only metrics the package
exports, and a real Prometheus (Debian's) scraping a real worker answers the dashboard's
queries and raises the alerts.

Without Debian's ``prometheus`` package (``promtool`` and ``prometheus``) the tests that need
it are skipped, saying so; `.ci/run` installs it when it can.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import BROKER_URL, STORE_URL, WorkerGroup, free_port, wait_for
from tests.prometheus import (
    ALERTS,
    ALERTS_TEST,
    PrometheusServer,
    binary,
    dashboard,
    exported_metrics,
    metrics_named,
    panel_queries,
)

ALERT_NAMES = ("CeleryThrottleStoreUnreachable", "CeleryThrottleParkedTasksLost", "CeleryThrottleStoreRestarted",
               "CeleryThrottleWaitOverMaxWait", "CeleryThrottleAdaptiveLimitAtFloor")


def _binary_or_skip(name: str) -> str:
    path = binary(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian's prometheus package: apt-get install prometheus)")
    return path


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_binary_or_skip("promtool"), *args], capture_output=True, text=True, timeout=120,
                          check=False)


# -- the rules ------------------------------------------------------------------------------
@pytest.mark.pure
def test_the_alert_rules_pass_promtool_check() -> None:
    done = _promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in done.stdout, done.stdout


@pytest.mark.pure
def test_each_alert_fires_on_its_series_and_not_otherwise() -> None:
    # (alerts_test.yml: for each alert, the series it is meant for and others beside it,
    # and when it must fire and when not)
    done = _promtool("test", "rules", str(ALERTS_TEST))
    assert done.returncode == 0, done.stdout + done.stderr
    tested = ALERTS_TEST.read_text("utf-8")
    for name in ALERT_NAMES:
        assert f"alertname: {name}" in tested, f"alerts_test.yml does not test {name}"


@pytest.mark.pure
def test_the_rules_name_only_metrics_the_package_exports() -> None:
    named = metrics_named(ALERTS.read_text("utf-8"))
    assert named and named <= exported_metrics(), f"not exported: {sorted(named - exported_metrics())}"


# -- the dashboard --------------------------------------------------------------------------
@pytest.mark.pure
def test_the_dashboard_is_a_grafana_dashboard_of_panels_that_do_not_overlap() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "two panels have one id"
    for panel in board["panels"]:
        assert panel["type"] in ("timeseries", "stat") and panel["title"] and panel["targets"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        for target in panel["targets"]:  # every variable it uses is the dashboard's, or Grafana's own
            for used in set(re.findall(r"\$(\w+)", target["expr"])):
                assert used.startswith("__") or used in variables, f"{panel['title']!r} uses ${used}"


@pytest.mark.pure
def test_each_panel_names_only_metrics_the_package_exports_and_shows_them_all() -> None:
    exported = exported_metrics()
    assert "celery_throttle_wait_exceeded_total" in exported and "celery_throttle_parked_waiting" in exported
    shown: set[str] = set()
    for title, expr in panel_queries():
        named = metrics_named(expr)
        assert named, f"{title!r} names no metric of the package: {expr}"
        assert named <= exported, f"{title!r} names metrics the package does not export: {sorted(named - exported)}"
        shown |= named
    assert shown == exported, f"metrics without a panel: {sorted(exported - shown)}"


@pytest.mark.pure
def test_each_panel_expression_parses(tmp_path: Path) -> None:
    # promtool parses a rule's expression offline: each panel's becomes a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"celery_throttle_dashboard:panel_{n}", "expr": expr}
        for n, (_, expr) in enumerate(panel_queries())]}]}
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))  # (JSON is YAML)
    done = _promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


# -- a real Prometheus, a real worker ------------------------------------------------------------
@pytest.fixture
def scraped(prefix: str, store_client: redis.Redis, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A worker scraped by a real Prometheus (its metrics in multiprocess mode, 2 prefork
    processes), and a second one whose store is a port where nothing answers; the alert
    rules loaded."""
    _binary_or_skip("prometheus")
    pytest.importorskip("prometheus_client")
    live_port, dead_port = free_port(), free_port()
    (tmp_path / "live").mkdir()
    (tmp_path / "dead").mkdir()
    live = WorkerGroup(prefix, BROKER_URL, STORE_URL, count=1, concurrency=2,
                       env={"CT_METRICS_PORT": str(live_port), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "live"),
                            "CT_CHECK_AT_PUBLISH": "0"})
    dead = WorkerGroup(f"{prefix}-dead", BROKER_URL, f"redis://127.0.0.1:{free_port()}/0", count=1, concurrency=1,
                       env={"CT_METRICS_PORT": str(dead_port), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "dead")})
    prometheus = PrometheusServer({"celery-live": [f"127.0.0.1:{live_port}"],
                                   "celery-dead-store": [f"127.0.0.1:{dead_port}"]}, [ALERTS])
    try:
        prometheus.start()
        live.start()
        dead.start()
        yield {"live": live, "dead": dead, "prometheus": prometheus, "dead_target": f"127.0.0.1:{dead_port}"}
    finally:
        live.stop()
        dead.stop()
        prometheus.stop()


@pytest.mark.workers
def test_a_real_prometheus_scraping_a_real_worker_answers_the_dashboard_and_raises_the_alerts(
        scraped: dict[str, Any]) -> None:
    live: WorkerGroup = scraped["live"]
    dead: WorkerGroup = scraped["dead"]
    prometheus: PrometheusServer = scraped["prometheus"]
    label = uuid.uuid4().hex[:10]
    # Given a producer (which imports the tasks and sends, unchecked at publish: the workers
    # are what Prometheus scrapes) that sends well over the limits: 30 calls of a 5/s task,
    # 6 of a task of 2 slots, 6 of a 2/m task that waits 5 s at most (4 fail with
    # WaitTooLong), 9 of a 3/4s task (a line that waits for seconds), 12 of an adaptive task
    # whose downstream takes 3 a second (its level falls below its declared 20/s), 6 of a
    # 2/s task in shadow mode (all run; 4 would have been held)
    live.records.set(f"{live.prefix}:downstream-limit", 3)
    live.produce({"how": "delay", "task": "below", "args": [label], "count": 30},
                 {"how": "delay", "task": "adaptive_call", "args": [label, 0], "count": 12},
                 {"how": "delay", "task": "exporting", "args": [label, "acme", 0.5], "count": 6},
                 {"how": "delay", "task": "capped", "args": [label, "t1"], "count": 6},
                 {"how": "delay", "task": "slow_quota", "args": [label, "t2"], "count": 9},
                 {"how": "delay", "task": "shadowed", "args": [label, "t3"], "count": 6},
                 CT_CHECK_AT_PUBLISH="0", CT_METRICS_PORT="", PROMETHEUS_MULTIPROC_DIR="")
    # and a worker whose store does not answer, sent 3 calls (from a client without the plugin)
    for _ in range(3):
        dead.send("below", label)
    # When they have run (the 3/4s line takes 8 s or more)
    live.wait_starts(label, 30 + 2 + 9 + 12 + 6, timeout=180, settle=0)
    wait_for(lambda: len(live.notes("spans")) == 6, 60, 0.2, "the 6 bodies of 2 slots")
    wait_for(lambda: len(live.notes("gave-up")) >= 4, 60, 0.2, "the 4 tasks that waited past their max_wait")
    assert len(live.notes("gave-up")) == 4, live.notes("gave-up")

    # Then Prometheus scrapes both workers
    wait_for(lambda: all(prometheus.targets_up().values()) and len(prometheus.targets_up()) == 2, 60, 0.5,
             f"both targets up: {prometheus.targets_up()}")

    # and every panel of the dashboard has data: each expression as Grafana sends it ("All"
    # scopes and jobs) parses in Prometheus and returns series
    def answered(expr: str) -> list[dict[str, Any]]:
        return prometheus.query(expr)

    for title, expr in panel_queries():
        wait_for(lambda expr=expr: answered(expr), 90, 0.5, f"data for {title!r}: {expr}")

    # with the starts, deferrals and failures counted by the worker's processes
    def total(expr: str) -> float:
        return sum(float(s["value"][1]) for s in prometheus.query(expr))

    wait_for(lambda: total('sum(celery_throttle_admitted_total{job="celery-live"})') >= 30 + 6 + 2 + 9 + 12, 60, 0.5,
             "the admitted starts scraped")
    assert total('sum(celery_throttle_denied_total{job="celery-live", scope="tests.taskapp.below"})') >= 15
    exceeded = 'sum(celery_throttle_wait_exceeded_total{job="celery-live", scope="tests.taskapp.capped"})'
    wait_for(lambda: total(exceeded) >= 4, 60, 0.5, "the 4 failures with WaitTooLong scraped")
    assert total(exceeded) == 4

    # and the alerts: the worker that cannot reach its store (pending for 2 minutes, then
    # firing), the tasks that waited past their max_wait; and nothing was lost
    def active() -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {}
        for alert in prometheus.alerts():
            found.setdefault(alert["labels"]["alertname"], []).append(alert)
        return found

    def raised() -> dict[str, list[dict[str, Any]]] | None:
        now = active()
        return now if {"CeleryThrottleStoreUnreachable", "CeleryThrottleWaitOverMaxWait"} <= set(now) else None

    alerts = wait_for(raised, 120, 1.0, "StoreUnreachable and WaitOverMaxWait active")
    unreachable = alerts["CeleryThrottleStoreUnreachable"]
    assert [a["labels"]["instance"] for a in unreachable] == [scraped["dead_target"]], unreachable
    assert unreachable[0]["state"] in ("pending", "firing")
    waited = alerts["CeleryThrottleWaitOverMaxWait"]
    assert [(a["labels"]["job"], a["labels"]["scope"], a["state"]) for a in waited] == [
        ("celery-live", "tests.taskapp.capped", "firing")], waited
    assert set(alerts) == {"CeleryThrottleStoreUnreachable", "CeleryThrottleWaitOverMaxWait"}, alerts  # nothing lost
