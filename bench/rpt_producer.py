"""A usual producer, as its own process: ``import bench.rpt_app`` and ``.delay()``.

``python -m bench.rpt_producer TASK COUNT TENANTS [--bursts B --gap S] [--ids]``: sends
COUNT calls of ``bench.rpt_app.TASK(tenant)``, tenants taken in turn from the
comma-separated TENANTS; with ``--bursts``, B such batches ``--gap`` seconds apart. Never
finalizes the app, never uses ``send_task``. Prints one JSON line: how many were sent,
when the first and last send began and ended, and with ``--ids`` each task id with the
time its ``.delay()`` was called.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rpt_producer")
    p.add_argument("task")
    p.add_argument("count", type=int)
    p.add_argument("tenants")
    p.add_argument("--bursts", type=int, default=1)
    p.add_argument("--gap", type=float, default=0.0)
    p.add_argument("--ids", action="store_true")
    args = p.parse_args(argv)
    started = time.time()
    import bench.rpt_app as tasks  # the app, install(app), the tasks: what a producer imports

    imported = time.time()
    task = getattr(tasks, args.task)
    tenants = args.tenants.split(",")
    ids: dict[str, float] = {}
    first = time.time()
    sent = 0
    for burst in range(args.bursts):
        if burst:
            time.sleep(args.gap)
        for i in range(args.count):
            t = time.time()
            result = task.delay(tenants[i % len(tenants)])
            sent += 1
            if args.ids:
                ids[result.id] = t
    last = time.time()
    print(json.dumps({"sent": sent, "import_s": imported - started, "first": first, "last": last,
                      "finalized": tasks.app.finalized, "ids": ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
