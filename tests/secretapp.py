"""A Celery app module as users write one, whose throttle store has a password: it sets
the store's URL and options and calls ``celery_throttle.install(app)`` at import, for
``celery -A tests.secretapp report`` (and ``throttle doctor``) to show, or not.

CT_SECRET_URL is ``throttle_redis_url``, CT_SECRET_OPTIONS (JSON) ``throttle_redis_options``;
CT_SECRET_ORDER says when they are set:

- ``before`` (the default): ``app.conf.update(...)``, then ``install`` (the configuration is
  not loaded yet when install runs);
- ``after``: the configuration loaded, ``install``, then the settings set;
- ``namespace``: read by ``config_from_object(..., namespace="CELERY")`` as Django projects
  do, spelt ``CELERY_THROTTLE_REDIS_URL``.
"""

from __future__ import annotations

import json
import os

from celery import Celery

import celery_throttle

REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
ORDER = os.environ.get("CT_SECRET_ORDER", "before")
SETTINGS = {
    "broker_url": os.environ.get("CT_BROKER", f"{REDIS}/13"),
    "throttle_redis_url": os.environ["CT_SECRET_URL"],
    "throttle_redis_options": json.loads(os.environ.get("CT_SECRET_OPTIONS", "{}")),
    "throttle_key_prefix": os.environ.get("CT_PREFIX", "ct-test-secret"),
}

app = Celery("secretapp", set_as_current=False)
if ORDER == "namespace":
    app.config_from_object({f"CELERY_{name.upper()}": value for name, value in SETTINGS.items()},
                           namespace="CELERY")
    celery_throttle.install(app)
elif ORDER == "after":
    _ = app.conf.broker_url  # (loads the configuration)
    celery_throttle.install(app)
    app.conf.update(SETTINGS)
else:
    app.conf.update(SETTINGS)
    celery_throttle.install(app)
