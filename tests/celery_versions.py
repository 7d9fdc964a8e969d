"""``python -m tests.celery_versions 5.3 5.5``: the contract with Celery's internals
(tests/pure/test_internals.py) on other Celery versions. CI runs it on the oldest supported
and one between; the suite runs it on the newest (the one installed).

For each version: a new virtualenv outside the tree with that Celery (and what the plugin
needs at import), then the contract's tests, from this checkout. A version whose shapes
changed fails there, naming the function of celery_throttle/celery_parts/internals.py concerned.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What the plugin imports, besides Celery (pyproject.toml's dependencies), and pytest.
NEEDS = ("kombu[redis]", "redis", "click", "rich", "msgpack", "pytest")


def check(version: str, where: Path) -> bool:
    env_dir = where / f"celery-{version}"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", f"celery[redis]=={version}.*", *NEEDS],
                             capture_output=True, text=True, check=False)
    if install.returncode != 0:
        print(f"celery {version}: could not install: {install.stderr.strip()[-2000:]}", file=sys.stderr)
        return False
    installed = subprocess.run([python, "-c", "import celery; print(celery.__version__)"],
                               capture_output=True, text=True, check=False).stdout.strip()
    # (--noconftest: the suite's fixtures need its test extras; the contract needs none)
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           "-o", "addopts=", "tests/pure/test_internals.py"], cwd=ROOT, check=False)
    print(f"celery {installed}: the contract with its internals {'holds' if done.returncode == 0 else 'FAILS'}",
          flush=True)
    return done.returncode == 0


def main(versions: list[str]) -> int:
    if not versions:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ct-celery-") as where:
        results = [check(version, Path(where)) for version in versions]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
