"""``python -m bench.llm_producer TASK LABEL ACCOUNT N [PACE]``: section 15's producer, as
users write one: it imports bench.llmworker (configured from CB_* as its workers are, so
its sends are checked at publish), sends calls 0..N-1 of TASK with ``.apply_async()``, all
at once or one every PACE seconds, and prints one JSON line: when the first send began, how
long the sends took, and the task ids in call order."""

from __future__ import annotations

import json
import sys
import time

from bench import llmworker


def main(name: str, label: str, account: str, calls: int, pace: float = 0.0) -> dict[str, object]:
    task = getattr(llmworker, name)
    ids = []
    t0 = time.time()
    with llmworker.app.producer_or_acquire() as pub:
        for i in range(calls):
            if pace:
                time.sleep(max(0.0, t0 + i * pace - time.time()))
            ids.append(task.apply_async((label, account, i), producer=pub).id)
    return {"t0": t0, "send_s": time.time() - t0, "ids": ids}


if __name__ == "__main__":
    pace = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), pace)))
