"""The leak check (tests/leakcheck.py, tests/leakcheck_plugin.py): a run that leaves a key
in a test database fails, and says which key and which test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from tests.helpers import BROKER_URL, ROOT

pytestmark = pytest.mark.workers  # (it runs pytest as a subprocess)

LEAKY_TEST = '''
import redis

def test_leaves_a_key():
    redis.Redis.from_url({url!r}).set({key!r}, 1)

def test_cleans_up():
    client = redis.Redis.from_url({url!r})
    client.set({key!r} + "-deleted", 1)
    client.delete({key!r} + "-deleted")
'''


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_test_that_leaves_a_key_fails_the_run_and_is_named(tmp_path: Path, store_client: redis.Redis) -> None:
    # Given a test that leaves a key in the broker's database, and one that deletes its own
    # (named to sort first: keys that tests running beside it write are listed too, sorted)
    key = f"!ct-leak-{uuid.uuid4().hex[:8]}"
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST.format(url=BROKER_URL, key=key))
    broker = redis.Redis.from_url(BROKER_URL)
    try:
        # When they run under the plugin
        out = _run("-m", "pytest", "-q", "-p", "tests.leakcheck_plugin", "-p", "no:cacheprovider", str(tmp_path))
        # Then the run fails although both passed, naming the key and the test that made it
        # (other tests of this run, writing beside it, may be named too: not asserted)
        assert out.returncode == 1 and "2 passed" in out.stdout, out.stdout + out.stderr
        named = [line for line in out.stdout.splitlines() if "test_leaky.py::test_leaves_a_key:" in line]
        assert any(f"db13:{key}" in line for line in named), out.stdout  # (a line of keys beside it may come first)
        assert "-deleted" not in out.stdout
        # and the check of a whole command (make test's, with CT_LEAKCHECK=1) says the same
        broker.delete(key)
        whole = _run("-m", "tests.leakcheck", sys.executable, "-c",
                     f"import redis; redis.Redis.from_url({BROKER_URL!r}).set({key!r}, 1, ex=60)")
        assert whole.returncode == 1 and "key(s) left (with a TTL): " + key in whole.stderr, whole.stderr
    finally:
        broker.delete(key)
        broker.close()
