import json

import pytest
import redis

_c = redis.Redis(port=6379, db=13)
_z = redis.Redis(port=6379, db=0)
def _keys():
    return {k for k in _c.scan_iter(count=1000)} | {b"db0:" + k for k in _z.scan_iter(count=1000)}
@pytest.fixture(autouse=True)
def _leaks(request):
    before = _keys()
    yield
    after = _keys()
    new = sorted(k.decode(errors="replace") for k in after - before)
    if new:
        with open("/tmp/leaks.jsonl", "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "new": new[:10], "n": len(new)}) + "\n")
