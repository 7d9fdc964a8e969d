"""``python -m tests.on_cluster [pytest args]``: run tests with the throttle's store on a Redis
Cluster of 3 masters, started on loopback for the run (tests/harness.py) and stopped after;
the broker, the results and the tests' own notes stay on the tests' Redis. ``make test``
runs the tests marked ``any_store`` so: each guarantee whose test names the store holds on a
cluster too (the tests find it through ``CT_STORE_URL``)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import redis_cluster


def main(args: list[str]) -> int:
    with redis_cluster() as ports:
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        print(f"tests.on_cluster: the store on a cluster of {len(ports)} masters, {url}", flush=True)
        return subprocess.call([sys.executable, "-m", "pytest", *args], env=dict(os.environ, CT_STORE_URL=url))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
