"""Per-tenant batch quotas with plans.

Each tenant's exports are held to its plan's hourly quota plus 2/s, so that one tenant's
batch never floods the database. Both rates come from one callable, so a plan change takes
effect at the next call. A tenant that spends its quota waits: its tasks are parked in
Redis, not held in worker memory, and come back as the window frees up.

    celery -A examples.tenant_quotas worker
"""

from __future__ import annotations

from celery import Celery

import celery_throttle
from celery_throttle import throttle

app = Celery("tenant_quotas", broker="redis://localhost:6379/0")
celery_throttle.install(app)

PLANS = {"free": "100/h", "team": "1000/h", "enterprise": "20000/h"}


def plan_of(tenant_id: str) -> str:
    """Look the plan up wherever it lives (here: a prefix of the id)."""
    return tenant_id.split("-", 1)[0] if tenant_id.split("-", 1)[0] in PLANS else "free"


@app.task
@throttle(lambda tenant_id, job_id: [PLANS[plan_of(tenant_id)], "2/s"], key="{tenant_id}")
def export(tenant_id: str, job_id: int) -> None:
    """Export one job for one tenant."""
