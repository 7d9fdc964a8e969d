"""Worker subprocesses running ``bench.workerapp``, a client to feed them, and their RSS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from bench.common import BROKER_URL, OUT_DIR, ROOT, STORE_URL, store_client, wait_until

TASKS = "bench.workerapp"


class WorkerGroup:
    """``count`` workers with ``concurrency`` prefork processes each, all on one prefix,
    running the Celery app module ``app`` (``bench.workerapp`` unless said otherwise)."""

    def __init__(self, prefix: str, name: str, count: int = 2, concurrency: int = 2,
                 env: dict[str, str] | None = None, app: str = TASKS) -> None:
        self.prefix = prefix
        self.app = app
        self.name = name
        self.count = count
        self.concurrency = concurrency
        #: The queue every worker consumes from the start; more with :meth:`consume`.
        self.queue = f"{prefix}-{name}"
        self.env = dict(env or {})
        self.procs: list[subprocess.Popen] = []
        self.logdir = OUT_DIR / "logs"
        self.logs: list[Path] = []
        self.client = Celery("bench-client", broker=BROKER_URL, set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.client.conf.task_ignore_result = True
        self.records = store_client()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, timeout: float = 90) -> WorkerGroup:
        self.logdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(CB_PREFIX=self.prefix, CB_STORE=STORE_URL, CB_BROKER=BROKER_URL,
                   CB_QUEUE=self.queue, PYTHONPATH=str(ROOT))
        env.update(self.env)
        for i in range(self.count):
            log = self.logdir / f"{self.name}-w{i}-{uuid.uuid4().hex[:6]}.log"
            cmd = [sys.executable, "-m", "celery", "-A", self.app, "worker", "-Q", self.queue,
                   "-c", str(self.concurrency), "-P", "prefork", "-n", f"{self.name}{i}-{self.prefix}@%h",
                   "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            self.logs.append(log)
        for i in range(self.count):
            if not wait_until(lambda i=i: self._ready(i), timeout, 0.2):
                raise RuntimeError(f"worker {i} of {self.name} not ready in {timeout}s:\n{self.tail(i)}")
        return self

    def _ready(self, i: int) -> bool:
        if self.procs[i].poll() is not None:
            raise RuntimeError(f"worker {i} of {self.name} exited:\n{self.tail(i)}")
        return b" ready." in self.logs[i].read_bytes()

    def tail(self, i: int, chars: int = 3000) -> str:
        return self.logs[i].read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM our workers (each in its own process group), SIGKILL after 20 s."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.client.close()

    def errors(self) -> list[str]:
        """Error lines from the worker logs (tracebacks, failures)."""
        out = []
        for log in self.logs:
            for line in log.read_text(errors="replace").splitlines():
                if " ERROR/" in line or " CRITICAL/" in line or "Traceback" in line:
                    out.append(line.strip()[:300])
        return out

    # -- feeding ------------------------------------------------------------------------
    def send(self, task: str, label: str, queue: str, count: int) -> list[str]:
        """Send ``count`` calls of ``task(label)`` to ``queue``; returns their ids."""
        ids = []
        with self.client.producer_or_acquire() as producer:
            for _ in range(count):
                result = self.client.send_task(f"{self.app}.{task}", args=(label,), queue=queue,
                                               producer=producer)
                ids.append(result.id)
        return ids

    def consume(self, queue: str, on: bool = True) -> int:
        """Make every worker start (or stop) consuming ``queue``; returns how many replied."""
        control = self.client.control
        if on:
            replies = control.add_consumer(queue, routing_key=queue, reply=True, timeout=5,
                                           limit=self.count)
        else:
            replies = control.cancel_consumer(queue, reply=True, timeout=5, limit=self.count)
        return len(replies or [])

    # -- reading back -------------------------------------------------------------------
    def starts(self, label: str) -> list[tuple[float, str]]:
        raw = self.records.lrange(f"{self.prefix}:starts:{label}", 0, -1)
        out = []
        for item in raw:
            t, _, task_id = item.decode().partition(" ")
            out.append((float(t), task_id))
        return out

    def start_count(self, label: str) -> int:
        return int(self.records.llen(f"{self.prefix}:starts:{label}"))

    def counter(self, name: str, label: str) -> int:
        return int(self.records.get(f"{self.prefix}:{name}:{label}") or 0)

    def wait_starts(self, label: str, count: int, timeout: float, settle: float = 1.0) -> bool:
        ok = bool(wait_until(lambda: self.start_count(label) >= count, timeout, 0.1))
        time.sleep(settle)
        return ok

    # -- memory ---------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Worker main processes and their pool children."""
        out: list[int] = []
        for proc in self.procs:
            if proc.poll() is None:
                out.append(proc.pid)
                out.extend(_children(proc.pid))
        return out

    def rss(self) -> int:
        """Total resident memory (bytes) of every worker process."""
        return sum(self.rss_by_pid().values())

    def rss_by_pid(self) -> dict[int, int]:
        """Resident memory (bytes) of each worker process."""
        return {pid: rss_of(pid) for pid in self.pids()}

    def cpu(self) -> float:
        """CPU seconds (user + system) used so far by every worker process."""
        return sum(cpu_of(pid) for pid in self.pids())


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        pass
    out = []
    for entry in Path("/proc").iterdir():  # fallback: scan parents
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of one process, from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def rss_of(pid: int) -> int:
    """VmRSS of one process in bytes (psutil when installed, else /proc)."""
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def stop_all(groups: Sequence[Any]) -> None:
    for group in groups:
        try:
            group.stop()
        except Exception as exc:  # keep stopping the others
            print(f"could not stop worker group {getattr(group, 'name', '?')}: {exc}", file=sys.stderr)
