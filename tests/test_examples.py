"""The examples stay true: they import, and their tasks end up throttled as documented."""

from __future__ import annotations

import importlib

import pytest

from celery_throttle import ConfigurationError, signals, throttle
from celery_throttle.controller import controller
from celery_throttle.spec import declared_spec
from celery_throttle.worker import patch_tasks


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
