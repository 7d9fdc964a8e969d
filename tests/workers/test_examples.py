"""The examples stay true: they import, and their tasks end up throttled as documented."""

from __future__ import annotations

import importlib

import pytest

from celery_throttle import ConfigurationError, signals, throttle
from celery_throttle.check.controller import controller
from celery_throttle.core.spec import declared_spec
from celery_throttle.integration.worker import patch_tasks


@pytest.mark.parametrize("module", ["examples.external_api", "examples.tenant_quotas",
                                    "examples.rules", "examples.demo_app"])
def test_example_tasks_are_throttled(module: str) -> None:
    # (an example's signal receivers, connected at import, would count this process's
    # denials in its Redis for the rest of the run: they are disconnected after)
    receivers = list(signals.task_throttled.receivers)
    try:
        mod = importlib.import_module(module)
    finally:
        signals.task_throttled.receivers[:] = receivers
        signals.task_throttled.sender_receivers_cache.clear()
    ctl = controller(mod.app)
    patch_tasks(ctl)
    # (@app.task tasks are shared with every app: keep this module's own)
    own = [t for t in mod.app.tasks.values() if type(t).__module__ == module]
    assert own
    for task in own:
        assert type(task).__dict__.get("_throttle_hooked"), task.name
        assert declared_spec(task) or ctl.checker.rule_for(task.name)


def test_rules_example_matches_by_name() -> None:
    from examples import rules

    ctl = controller(rules.app)
    assert ctl.checker.rule_for("billing.tasks.charge").scope == "stripe"
    crm = ctl.checker.rule_for("crm.tasks.sync_contacts")
    assert crm.algorithm == "fixed" and [str(r) for r in crm.rates] == ["100/m", "5000/d"]
    assert ctl.checker.rule_for("other.task") is None


def test_stacking_two_throttles_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="one @throttle"):
        @throttle("10/s")
        @throttle("5/s")
        def twice(x): ...


def test_the_demo_reads_well_piped_in_80_columns(store_client: object) -> None:
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT, STORE_URL

    # Given the demo run with its output piped (no terminal), on the tests' Redis
    out = subprocess.run([sys.executable, "-m", "examples.demo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False, env=dict(os.environ, DEMO_REDIS_URL=STORE_URL, COLUMNS="200"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # Then every line fits 80 columns, no stream's name is cut, the summary's title starts
    # a line of its own after a blank one, and each stream's verdict is a word used nowhere
    # else in the CLI ("held" is what a limit does to a task there)
    assert all(len(line) <= 80 for line in lines), out.stdout
    assert "…" not in out.stdout
    summary = next(i for i, line in enumerate(lines) if line.startswith("Summary:"))
    assert lines[summary - 1] == "" and lines[summary - 2].strip(), out.stdout
    for stream in ("export:acme", "export:globex", "github-api"):
        assert sum(1 for line in lines if line.split()[:1] == [stream]) == 2  # progress and summary
        assert next(line for line in lines[summary:] if line.split()[:1] == [stream]).rstrip().endswith("obeyed")
    assert "held" not in out.stdout
