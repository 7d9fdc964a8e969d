"""Rules for tasks you do not own: throttle them by name, without touching their code.

The tasks below stand for a third-party package's tasks. The rules throttle them by glob
on the task name; the first matching rule wins, so specific names come before globs.

    celery -A examples.rules worker
"""

from __future__ import annotations

from celery import Celery

import celery_throttle

app = Celery("rules", broker="redis://localhost:6379/0")
app.conf.throttle_rules = {
    "billing.tasks.charge": {"rate": "5/s", "scope": "stripe"},
    "crm.tasks.*": {"rate": ["100/m", "5000/d"], "key": "{tenant_id}", "algorithm": "fixed"},
}
celery_throttle.install(app)


@app.task(name="billing.tasks.charge")
def charge(customer_id: str, amount: int) -> None:
    """A task from a billing package."""


@app.task(name="crm.tasks.sync_contacts")
def sync_contacts(tenant_id: str) -> None:
    """A task from a CRM package."""
