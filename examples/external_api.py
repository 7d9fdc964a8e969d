"""An external API capped by two rates, shared by every task that calls it.

GitHub allows 5000 requests an hour per token, and bursts above ~10/s get secondary
rate limits. Both tasks below count against one "github-api" scope: together they never
exceed 10 starts in any second nor 5000 in any hour, across all workers. A call that
fetches a page of N issues costs N units.

    celery -A examples.external_api worker
"""

from __future__ import annotations

from celery import Celery

import celery_throttle
from celery_throttle import throttle

app = Celery("external_api", broker="redis://localhost:6379/0")
celery_throttle.install(app)

GITHUB = ("10/s", "5000/h")


@app.task
@throttle(*GITHUB, scope="github-api", key="{token_id}")
def fetch_repo(token_id: str, repo: str) -> None:
    """One request per call."""


@app.task
@throttle(*GITHUB, scope="github-api", key="{token_id}", cost=lambda token_id, repo, numbers: len(numbers))
def fetch_issues(token_id: str, repo: str, numbers: list[int]) -> None:
    """One request per issue number."""
