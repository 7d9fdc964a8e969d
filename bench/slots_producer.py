"""``python -m bench.slots_producer TASK A B SECONDS``: section 14's producer, as users write
one: it imports bench.slots_app (configured from CB_* as its workers are), sends A calls of
its TASK for tenant ``a`` with ``.delay()``, then B for tenant ``b``, and prints one JSON
line: when each send of B returned, and how long A's took. It never finalizes the app."""

from __future__ import annotations

import json
import sys
import time

from bench import slots_app


def main(name: str, flood: int, others: int, seconds: float) -> dict[str, object]:
    task = getattr(slots_app, name)
    t0 = time.time()
    for _ in range(flood):
        task.delay("a", seconds)
    sent_a = time.time()
    b_sends = []
    for _ in range(others):
        task.delay("b", seconds)
        b_sends.append(time.time())
    return {"t0": t0, "flood_s": sent_a - t0, "b_sends": b_sends, "finalized": slots_app.app.finalized}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))))
