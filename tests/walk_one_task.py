"""The walk of one task, from ``.delay()`` to its slot's give-back, through the package's
folders: ``python -m tests.walk_one_task`` (a Redis at CT_REDIS_URL or 127.0.0.1:6379, db 13,
keys under a prefix of its own, deleted after).

One task of ``@throttle("10/s", concurrency=2, key="{tenant}")`` is sent with ``.delay()``
from this process (the app not finalized, as a producer's is not) and run by a real
worker in a thread of it (``celery.contrib.testing.worker.start_worker``: its consumer, its
solo pool), every call into ``celery_throttle`` recorded (``sys.setprofile`` and
``threading.setprofile``). It prints, for the publish and the worker's side:

- the modules of the package it touches, and its script calls (by the name the store
  loads each under: ``sliding`` is window.lua for a sliding window);
- its folders in the order the walk first touches each module, runs of one folder as one
  step (``integration > check > core > store``: each folder named once): how many times
  each folder is named;
- down one call stack (the package's frames, outermost first, runs of one folder as one),
  the most times one folder is named: 1 when every call goes down the layers;
- the climbs: calls from a folder to one above it in the layers (pyproject.toml's
  contract; only a callback handed down can make one).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_throttle
from celery_throttle import throttle

PACKAGE = Path(celery_throttle.__file__).parent
#: The layers of pyproject.toml's first contract, top first.
LAYERS = (("ops", "embedded"), ("integration",), ("waits",), ("check",), ("celery_parts",), ("store",),
          ("core", "signals"))
REDIS = os.environ.get("CT_REDIS_URL", "redis://127.0.0.1:6379")


def folder_of(module: str) -> str:
    head = module.split("/")[0]
    return head.removesuffix(".py")


def layer(folder: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if folder in names or folder == "__init__")


class Recorder:
    """Every call into the package: (thread, module, function) and the caller's module; the scripts run."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, str | None]] = []
        self.scripts: dict[str, list[str]] = {}
        #: thread -> the most times one folder is named down one call stack (runs of a folder as one)
        self.deepest: dict[str, tuple[int, list[str]]] = {}
        self.on = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):
            return
        module = str(Path(path).relative_to(PACKAGE))
        stack: list[str] = []  # (the package's frames, callee first)
        back: Any = frame
        while back is not None:
            if back.f_code.co_filename.startswith(str(PACKAGE)):
                stack.append(str(Path(back.f_code.co_filename).relative_to(PACKAGE)))
            back = back.f_back
        caller = stack[1] if len(stack) > 1 else None
        thread = threading.current_thread().name
        self.calls.append((thread, module, frame.f_code.co_name, caller))
        path_down = [f for i, f in enumerate(folder_of(m) for m in reversed(stack)) if i == 0 or f != folder_of(
            list(reversed(stack))[i - 1])]
        most = max(Counter(path_down).values())
        if (most, len(path_down)) > (self.deepest.get(thread, (0, []))[0], len(self.deepest.get(thread, (0, []))[1])):
            self.deepest[thread] = (most, path_down)
        if module == "store/scripts.py" and frame.f_code.co_name == "run":
            self.scripts.setdefault(thread, []).append(str(frame.f_locals.get("script")))


def report(title: str, calls: list[tuple[str, str, str, str | None]], scripts: list[str],
           deepest: tuple[int, list[str]]) -> dict[str, Any]:
    modules = list(dict.fromkeys(module for _, module, _, _ in calls))
    steps: list[str] = []
    for module in modules:
        folder = folder_of(module)
        if not steps or steps[-1] != folder:
            steps.append(folder)
    climbs = Counter((caller, module) for _, module, _, caller in calls
                     if caller and folder_of(caller) != folder_of(module)
                     and layer(folder_of(caller)) > layer(folder_of(module)))
    named = Counter(steps)
    runs = ", ".join(f"{name} x {n}" for name, n in Counter(scripts).most_common()) or "none"
    print(f"\n{title}: {len(modules)} modules of the package's {len(list(PACKAGE.rglob('*.py')))}; script calls: {runs}")
    print("  modules in the order first touched:", ", ".join(modules))
    print("  folders:", " > ".join(steps))
    print("  times each folder is named:", ", ".join(f"{f} {n}" for f, n in named.most_common()))
    print(f"  down one call stack, the most times a folder is named: {deepest[0]} ({' > '.join(deepest[1])})")
    print("  climbs (a call up the layers):", sum(climbs.values()),
          "".join(f"\n    {caller} -> {module} ({n})" for (caller, module), n in climbs.most_common()))
    return {"modules": len(modules), "named": named, "climbs": sum(climbs.values())}


def main() -> None:
    prefix = f"ct-walk-{uuid.uuid4().hex[:8]}"
    url = f"{REDIS}/13"
    app = Celery("walk", broker=url, set_as_current=False)
    app.conf.task_default_queue = f"{prefix}-q"
    app.conf.throttle_redis_url = url
    app.conf.throttle_key_prefix = prefix
    celery_throttle.install(app)

    ran = threading.Event()

    @app.task(name="walk.call", shared=False)
    @throttle("10/s", concurrency=2, key="{tenant}")
    def call(tenant: str) -> None:
        ran.set()

    import celery.contrib.testing.tasks  # noqa: F401 - the worker's ping

    recorder = Recorder()
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING", shutdown_timeout=10):
            time.sleep(0.5)  # (the worker's own start, not the walk)
            recorder.on = True
            call.delay("acme")
            if not ran.wait(30):
                raise SystemExit("the task did not run")
            time.sleep(0.5)  # (its slot's give-back, after the body)
            recorder.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
    main_thread = threading.main_thread().name
    workers = {t for t, *_ in recorder.calls if t != main_thread and not t.startswith("celery-throttle")}
    publish = [c for c in recorder.calls if c[0] == main_thread]
    worker = [c for c in recorder.calls if c[0] in workers]
    scripts = {t: recorder.scripts.get(t, []) for t in (main_thread, *workers)}
    deepest = {t: recorder.deepest.get(t, (0, [])) for t in (main_thread, *workers)}
    report("publish (.delay() in the producer)", publish, scripts[main_thread], deepest[main_thread])
    report("the worker (consumer, pool, body's end)", worker, [s for t in workers for s in scripts[t]],
           max((deepest[t] for t in workers), default=(0, [])))


if __name__ == "__main__":
    main()
