"""Section 13: a store far away (a slow link, another region).

A burst of 30 ``sliding`` tasks at ``10/s`` (one key), one worker of 4 prefork
processes, with the throttle's store behind ``tests/slow_proxy.py``: every reply of the
store comes 0 ms (the proxy still in the path) or 100 ms late. The records stay on the
bench's own Redis. Side by side in each round, 3 rounds: the pace (tasks per second from
the first start to the last) at 100 ms over the pace at 0 ms (target >= 0.8), and the
reserved starts missed ("could not use its reserved start" in the worker's log: each one
goes to the back of the line).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import redis

from bench.common import STORE_URL, Results, fmt_num, max_in_window
from bench.workers import WorkerGroup
from tests.slow_proxy import spawn

SEC = "13 slow store"
TASKS, RATE, ROUNDS, DELAYS_MS = 30, "10/s", 3, (0, 100)


def _proxy(delay_ms: int) -> tuple[subprocess.Popen[bytes], str]:
    target = redis.connection.parse_url(STORE_URL)
    proc, port = spawn(target.get("port", 6379), delay_ms)
    return proc, f"redis://127.0.0.1:{port}/{target.get('db', 0)}"


def _one(prefix: str, delay_ms: int, round_: int) -> tuple[float, int, int]:
    """(first-to-last start, most starts in any 0.98 s, reserved starts missed)."""
    proxy, url = _proxy(delay_ms)
    group = WorkerGroup(f"{prefix}-s{delay_ms}-{round_}", f"slow{delay_ms}", count=1, concurrency=4,
                        env={"CB_RATE": RATE, "CB_THROTTLE_STORE": url})
    try:
        group.start()
        label = f"slow-{delay_ms}-{round_}"
        group.send("sliding", label, group.queue, TASKS)
        if not group.wait_starts(label, TASKS, timeout=120):
            raise RuntimeError(f"{group.start_count(label)} of {TASKS} started at {delay_ms} ms")
        starts = sorted(t for t, _ in group.starts(label))
        missed = sum(log.read_text(errors="replace").count("could not use its reserved start") for log in group.logs)
        return starts[-1] - starts[0], max_in_window(starts, 0.98), missed
    finally:
        group.stop()
        proxy.kill()
        proxy.wait(5)


def run_slow_store(res: Results, prefix: str, rounds: int = ROUNDS) -> None:
    runs: dict[int, list[tuple[float, int, int]]] = {d: [] for d in DELAYS_MS}
    for round_ in range(rounds):
        for delay in DELAYS_MS:
            runs[delay].append(_one(prefix, delay, round_))
            time.sleep(1)
    for delay, got in runs.items():
        spans = ", ".join(f"{s:.2f}s" for s, _, _ in got)
        res.add(SEC, f"reserved starts missed per burst of {TASKS} at {RATE}, store {delay} ms away", "sliding",
                fmt_num(sum(m for _, _, m in got) / len(got), 1), "<= 3" if delay else "",
                (max(m for _, _, m in got) <= 3) if delay else None,
                f"first-to-last start per round: {spans}; most starts in any 0.98 s: "
                f"{max(w for _, w, _ in got)} (limit 10)")
    ratios = [fast[0] / slow[0] for fast, slow in zip(runs[DELAYS_MS[0]], runs[DELAYS_MS[-1]])]
    res.add(SEC, "pace at 100 ms / pace at 0 ms (first-to-last start, side by side)", "sliding",
            fmt_num(min(ratios), 2), ">= 0.8", min(ratios) >= 0.8,
            f"per round: {', '.join(f'{r:.2f}' for r in ratios)}")


def main(argv: Any = None) -> None:  # python -m bench.slow_store: this section alone, printed
    res = Results()
    run_slow_store(res, f"ct-bench-slow-{int(time.time())}")
    for row in res.rows:
        print(row)


if __name__ == "__main__":
    main()
