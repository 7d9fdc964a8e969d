"""A producer as users write one: a process that imports the tasks module (which creates
the app and calls ``celery_throttle.install(app)``) and sends. It never finalizes the app
and never warms anything up.

    python -m tests.producer '{"sends": [{"how": "delay", "task": "pub_below",
                                          "args": ["label", "acme"], "count": 12}]}'

``how``: ``delay`` (``task.delay(*args)``), ``apply_async`` (with ``options``), ``send_task`` (``app.send_task(name,
args)``), ``group`` (one group of ``count`` signatures) or ``chord`` (a chord of them,
with ``collect`` as its callback); ``after``: seconds to wait before the send. Prints one JSON line: the ids sent (per send, in
order), each denial made at publish (task id, key, whether parked) and whether the app
was finalized by the end (using a ``@shared_task`` does that, as Celery's own proxy
looks it up in ``app.tasks``). Configured from the same CT_* variables as the workers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

os.environ["CT_PRODUCER"] = "1"  # (the task module's own notes are for workers)

from celery import chord, group

import tests.taskapp as tasks
from celery_throttle.signals import task_throttled

denials: list[dict[str, Any]] = []


@task_throttled.connect(weak=False)
def _denied(sender: Any, request: Any, delay: float, key: str, **_: Any) -> None:
    denials.append({"id": request.id, "key": key, "delay": delay})


def main(plan: dict[str, Any]) -> dict[str, Any]:
    sent: list[list[str]] = []
    for send in plan["sends"]:
        how, name, args, count = send["how"], send["task"], send["args"], send.get("count", 1)
        time.sleep(send.get("after", 0))  # (a send a while after the one before)
        if how == "delay":
            task = getattr(tasks, name)
            sent.append([task.delay(*args).id for _ in range(count)])
        elif how == "apply_async":  # (with "options", e.g. a priority)
            task = getattr(tasks, name)
            sent.append([task.apply_async(args, **send.get("options", {})).id for _ in range(count)])
        elif how == "send_task":
            sent.append([tasks.app.send_task(f"tests.taskapp.{name}", args).id for _ in range(count)])
        elif how == "group":
            result = group(getattr(tasks, name).s(*args) for _ in range(count)).apply_async()
            sent.append([r.id for r in result.results])
        elif how == "chord":
            result = chord(getattr(tasks, name).s(*args) for _ in range(count))(tasks.collect.s(args[0]))
            sent.append([r.id for r in result.parent.results])
        else:
            raise SystemExit(f"unknown way to send: {how!r}")
    return {"sent": sent, "denials": denials, "finalized": tasks.app.finalized}


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
