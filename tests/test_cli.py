"""``celery -A proj throttle ...``, through the real celery command."""

from __future__ import annotations

import os
import subprocess
import sys

import celery_throttle
from tests.helpers import ROOT, free_port
from tests.taskapp import app


def _run(prefix: str, *args: str, store: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CT_PREFIX=prefix, PYTHONPATH=str(ROOT))
    if store:
        env["CT_STORE"] = store
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.taskapp", "throttle", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def _celery(prefix: str, *args: str) -> str:
    out = _run(prefix, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_reset_and_parked_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("github-api", key="acme", rates=["10/m", "100/h"], cost=3)
    out = _celery(prefix, "status", "github-api", "--key", "acme")
    assert "sliding 10/m: used 3, remaining 7" in out
    assert "sliding 100/h: used 3, remaining 97" in out
    assert "parked: 0 waiting, 0 being released, 0 dead" in _celery(prefix, "parked")
    assert "reset github-api key=acme" in _celery(prefix, "reset", "github-api", "--key", "acme")
    assert "nothing counted" in _celery(prefix, "status", "github-api", "--key", "acme")


def test_an_unreachable_store_is_one_line_of_error_not_a_traceback(prefix: str) -> None:
    # Given a store nobody listens on
    out = _run(prefix, "status", "github-api", store=f"redis://127.0.0.1:{free_port()}/0")
    # Then the command fails with one line that says what and where
    assert out.returncode == 1
    assert out.stderr.startswith("Error: Redis at redis://127.0.0.1:"), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_pause_and_resume_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    out = _celery(prefix, "pause", "github-api", "--key", "acme", "--for", "90s")
    assert out.startswith("paused github-api key=acme until ")
    assert ctl.status("github-api", key="acme").paused_until is not None
    assert "paused until" in _celery(prefix, "status", "github-api", "--key", "acme")
    assert ctl.status("github-api", key="other").paused_until is None  # the key only
    assert "paused github-api key=None until resumed" in _celery(prefix, "pause", "github-api")
    assert "resumed github-api key=None" in _celery(prefix, "resume", "github-api")
    assert "resumed github-api key=acme" in _celery(prefix, "resume", "github-api", "--key", "acme")
    assert "was not paused" in _celery(prefix, "resume", "github-api", "--key", "acme")
    bad = _run(prefix, "pause", "github-api", "--for", "soon")
    assert bad.returncode != 0 and "use e.g. 90s, 5m, 2h, 1d" in bad.stderr


def test_set_and_unset_a_live_limit_from_the_command_line(prefix: str) -> None:
    ctl = celery_throttle.Throttle(app, {"key_prefix": prefix})
    ctl.acquire("github-api", rates=["10/s"], cost=3)
    assert "github-api key=None: limit set to 4/s" in _celery(prefix, "set", "github-api", "4/s")
    out = _celery(prefix, "status", "github-api")
    # What was counted under the declared 10/s still counts under the live 4/s
    assert "live limit 4/s" in out and "sliding 4/s: used 3, remaining 1" in out
    assert "back to the code's rates" in _celery(prefix, "unset", "github-api")
    assert "no live limit set" in _celery(prefix, "unset", "github-api")
    bad = _run(prefix, "set", "github-api", "fast")
    assert bad.returncode != 0 and "bad rate 'fast'" in bad.stderr and "Traceback" not in bad.stderr
