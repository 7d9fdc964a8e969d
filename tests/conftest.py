"""Fixtures: a real Redis, real worker subprocesses, and clean-up of every key written.

A missing Redis skips the tests locally but fails them in CI (CI=true).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import settings

# No per-example deadline: these machines are shared, and a slow example is not a wrong one.
# `make quick` (CT_QUICK=1) tries fewer examples per property: the inner loop, not the proof.
settings.register_profile("celery_throttle", deadline=None)
settings.register_profile("celery_throttle_quick", deadline=None, max_examples=10)

from kombu.transport.redis import Channel

from celery_throttle.celery_parts.journal_queue import journal_queue_name
from examples.local_redis import drop_bindings
from tests.harness import redis_cluster
from tests.helpers import (
    BROKER_URL,
    NOTES_URL,
    QUICK,
    STORE_URL,
    WorkerGroup,
    client_of,
    rabbitmq_or_skip,
    redis_or_skip,
)

settings.load_profile("celery_throttle_quick" if QUICK else "celery_throttle")

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: Fixtures of modules of their own (the keeper's tests' deploy; the fault tests' workers).
pytest_plugins = ["tests.journal_support", "tests.fault_support"]


@pytest.fixture(scope="session")
def store_client() -> redis.Redis:
    return redis_or_skip(STORE_URL)


def _clean(client: redis.Redis, prefix: str) -> None:
    """Delete the keys under ``prefix`` in ``client``'s database, and the journal queue of
    that prefix in the tests' Redis broker (the journal is on wherever the store is not the
    broker's own database: an app of a test's own writes one there)."""
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    if STORE_URL != NOTES_URL:  # (the store on a cluster: the tests' notes are still in db 12)
        with redis.Redis.from_url(NOTES_URL) as notes:
            for key in notes.scan_iter(match=f"{prefix}*", count=1000):
                notes.delete(key)
    journal = journal_queue_name(prefix)
    with redis.Redis.from_url(BROKER_URL) as broker:
        broker.delete(journal, *(f"{journal}{Channel.sep}{step}" for step in Channel.priority_steps))
        drop_bindings(broker, [journal])


@pytest.fixture
def prefix(store_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    value = f"ct-test-{uuid.uuid4().hex[:10]}"
    yield value
    _clean(store_client, value)


@pytest.fixture(scope="session", params=["redis", "rabbitmq"], ids=["redis-broker", "rabbitmq-broker"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The behaviour suite runs with Redis as broker and with RabbitMQ (the store is Redis)."""
    if request.param == "redis":
        return BROKER_URL
    return rabbitmq_or_skip(RABBITMQ_URL)


@pytest.fixture(scope="session")
def workers(store_client: redis.Redis, broker_url: str) -> Iterator[WorkerGroup]:
    """Two worker processes, two pool processes each, shared by the behaviour tests.

    Tests keep out of each other's way with scopes, keys and labels of their own.
    """
    prefix = f"ct-test-{uuid.uuid4().hex[:10]}"
    group = WorkerGroup(prefix=prefix, broker=broker_url, store=STORE_URL, count=2,
                        concurrency=2, env={"CT_RECORD": "100000"})
    group.start()
    yield group
    group.stop()  # (its queues and their bindings with it)
    _clean(store_client, prefix)



# -- tiers ----------------------------------------------------------------------------
# Every test is in one tier, the folder it lives in (pyproject.toml lists the markers):
# `make quick` runs the first two, `make test` all of them.
#   tests/pure/     no Redis, no worker: rates, keys, declarations, the script's format
#   tests/script/   a real Redis, no worker process: the scripts against the model, the
#                   controller used directly, the upgrade corpus, the keeper run by hand
#   tests/workers/  real Celery workers (subprocesses, or Celery's in-process test worker)
#                   or the CLI as a subprocess
#   tests/faults/   workers and servers that are killed, slowed or filled on purpose
# A test's own marker wins over its folder's (a pure test among a file of worker tests).
TIERS = ("pure", "script", "workers", "faults")
TESTS = Path(__file__).resolve().parent
#: Fixtures that start workers, and those that reach Redis: a pure test asks for neither,
#: a script test for no worker.
_WORKER_FIXTURES = {"workers", "pool_workers", "group_factory", "app", "idle_queue"}
_REDIS_FIXTURES = {"store_client", "prefix", "store", "clock", "redis_client", "ctl"}


def _folder_tier(item: pytest.Item) -> str | None:
    folder = item.path.resolve().parent
    return folder.name if folder.parent == TESTS and folder.name in TIERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        marked = [tier for tier in TIERS if item.get_closest_marker(tier)]
        tier = marked[0] if marked else _folder_tier(item)
        if tier is None:
            wrong.append(f"{item.nodeid}: in no tier (put it in tests/pure, script, workers or faults)")
            continue
        if not marked:
            item.add_marker(getattr(pytest.mark, tier))
        used = set(getattr(item, "fixturenames", ()))
        needs = used & _WORKER_FIXTURES if tier in ("pure", "script") else set()
        needs |= used & _REDIS_FIXTURES if tier == "pure" else set()
        if needs:
            wrong.append(f"{item.nodeid}: a {tier} test asks for {', '.join(sorted(needs))}")
    if wrong:
        raise pytest.UsageError("tests out of their tier (tests/conftest.py, \"tiers\"):\n  " + "\n  ".join(wrong))


# -- a Redis Cluster of 3 masters on loopback, for the tests that need one ---------------
@pytest.fixture
def cluster_url() -> Iterator[str]:
    with redis_cluster() as ports:
        yield f"redis+cluster://127.0.0.1:{ports[0]}"


def _journal_owner_gone(queue: str, store: redis.Redis) -> bool:
    """Whether ``queue`` is the journal of a test whose keys are all gone from the store."""
    name = queue.split(Channel.sep, 1)[0]
    if not name.startswith(JOURNAL_OF_A_TEST):
        return False
    prefix = name[len("celery_throttle.journal."):]
    return next(store.scan_iter(match=f"{prefix}*", count=1000), None) is None


#: The journal queues the tests' apps write in the Redis broker (key prefixes ct-test-...).
JOURNAL_OF_A_TEST = journal_queue_name("ct-test-")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A journal queue whose test is over and left no key in the store goes too: a worker's
    last kept or gone event can reach the broker after its test deleted the queue (the
    journal is on wherever the store is not the broker's own database). Only in the
    process that ends the run (not each xdist worker), and never a queue whose test still
    holds keys (another pass may be running it)."""
    if hasattr(session.config, "workerinput"):
        return
    try:
        store, broker = client_of(STORE_URL), redis.Redis.from_url(BROKER_URL)
        with store, broker:
            gone = [k.decode() for k in broker.scan_iter(match=f"{JOURNAL_OF_A_TEST}*", count=1000)]
            gone = [k for k in gone if _journal_owner_gone(k, store)]
            if gone:
                broker.delete(*gone)
            drop_bindings(broker, lambda queue: _journal_owner_gone(queue, store))
    except redis.RedisError:
        pass  # (no Redis: nothing was written)
