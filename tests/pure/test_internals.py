"""The contract with Celery's internals: each private shape celery_throttle/celery_parts/internals.py
leans on, asserted on the installed Celery. CI runs this file on the oldest Celery we
support and on the newest (.ci/run), so that an upgrade that changes one fails here,
naming the function of internals.py that needs a change, before a worker misbehaves.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task, current_app
from celery.app import trace as celery_trace
from celery.bootsteps import Blueprint
from celery.contrib.testing.mocks import TaskMessage
from celery.local import PromiseProxy
from celery.states import IGNORED
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.request import Request
from kombu.asynchronous.timer import Timer

from celery_throttle.celery_parts import internals


@pytest.fixture
def memory_app() -> Iterator[Celery]:
    app = Celery(f"contract-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    yield app
    app.close()


def _task(app: Celery) -> Any:
    """A task as the worker side sees it: app.tasks (the producer side, never finalized,
    is test_publish.py's, from producer processes that only import and send)."""
    @app.task(name="contract.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app.tasks["contract.add"]


def test_worker_hostname_reads_the_trace_optimizations(memory_app: Celery) -> None:
    # celery.app.trace._localized: [tasks, accept, hostname] once a worker set it up
    assert internals.worker_hostname() is None or isinstance(internals.worker_hostname(), str)
    # (the set-up makes the app current, as in a worker: the app current before is made
    # current again after, so that a @shared_task of a later test is not looked up in this one)
    before = current_app._get_current_object()
    celery_trace.setup_worker_optimizations(memory_app, "node@contract")
    try:
        assert internals.worker_hostname() == "node@contract", "celery.app.trace._localized changed shape"
    finally:
        celery_trace.reset_worker_optimizations(memory_app)
        before.set_current()


def test_a_tracer_built_as_the_worker_builds_one_runs_the_task(memory_app: Celery) -> None:
    task = _task(memory_app)  # (read from app.tasks, as a worker reads it)
    tracer = internals.build_task_tracer(task)
    result = tracer(uuid.uuid4().hex, (2, 3), {}, {})
    assert result.retval == 5, "build_tracer's signature or result changed"


def test_has_own_tells_a_task_class_method_from_celerys() -> None:
    class Plain(Task):  # type: ignore[misc]
        name = "contract.plain"

    class Own(Task):  # type: ignore[misc]
        name = "contract.own"

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            pass

    assert not internals.has_own(Plain(), "before_start")
    assert internals.has_own(Own(), "before_start"), "celery.app.trace.task_has_custom changed"


def test_a_trace_context_carries_the_call() -> None:
    context = internals.trace_context({"id": "abc"}, (1,), {"k": 2})
    assert (context.id, context.args, context.kwargs, context.called_directly) == ("abc", (1,), {"k": 2}, False)


def test_a_deferred_trace_result_is_what_the_pool_reads_as_ignored() -> None:
    assert celery_trace.trace_ok_t._fields == ("retval", "info", "runtime", "retstr"), "trace_ok_t changed"
    result = internals.deferred_trace_result("x")
    assert isinstance(result, celery_trace.trace_ok_t)
    assert result.retval == "x" and result.info.state == IGNORED


def test_a_request_context_is_built_from_a_message(memory_app: Celery) -> None:
    task = _task(memory_app)
    task_id = uuid.uuid4().hex
    message = TaskMessage("contract.add", task_id, args=(1, 2), kwargs={"z": 1})
    context = internals.request_context_factory(task)(message)
    assert (context.id, context.task) == (task_id, "contract.add"), "Request(...)._context changed"


def test_the_function_of_a_lazy_task_is_found_without_finalizing(memory_app: Celery) -> None:
    def fun(x: int) -> int:
        return x

    proxy = memory_app.task(name="contract.lazy", shared=False)(fun)
    assert isinstance(proxy, PromiseProxy) and not memory_app.finalized
    assert internals.proxied_function(proxy) is fun, "PromiseProxy no longer keeps _Proxy__args"


def test_a_task_of_an_app_never_finalized_is_found_by_name(memory_app: Celery) -> None:
    @memory_app.task(name="contract.pending", shared=False)
    def pending() -> None:
        pass

    task = internals.registered_task(memory_app, "contract.pending")
    assert task is not None and task.name == "contract.pending", "app._tasks / app._pending changed"
    assert not memory_app.finalized
    assert internals.registered_task(memory_app, "contract.none") is None


def test_update_strategies_can_be_followed() -> None:
    assert list(inspect.signature(Consumer.update_strategies).parameters) == ["self"], \
        "Consumer.update_strategies changed"
    calls: list[str] = []
    consumer = SimpleNamespace(update_strategies=lambda: calls.append("celery"))
    internals.wrap_update_strategies(consumer, lambda: calls.append("ours"))
    consumer.update_strategies()
    assert calls == ["celery", "ours"]


def test_a_blueprint_runs_what_is_chained_on_its_close() -> None:
    calls: list[str] = []
    blueprint = Blueprint(on_close=lambda: calls.append("celery"))
    internals.chain_on_close(SimpleNamespace(blueprint=blueprint), lambda: calls.append("ours"))
    blueprint.close(SimpleNamespace(steps=[]))
    assert calls == ["ours", "celery"], "Blueprint.on_close is no longer called at close"


def test_the_requests_a_worker_holds_are_found(memory_app: Celery) -> None:
    task = _task(memory_app)
    waiting = Request(TaskMessage("contract.add", "in-timer", args=(1, 2)), app=memory_app, task=task)
    running = Request(TaskMessage("contract.add", "running", args=(1, 2)), app=memory_app, task=task)
    timer = Timer()
    timer.call_after(60, lambda request: None, (waiting,))
    worker_state.active_requests.add(running)
    try:
        found = [(where, request.id) for where, request in internals.held_requests(SimpleNamespace(timer=timer))]
    finally:
        worker_state.active_requests.discard(running)
        timer.clear()
    assert ("countdown", "in-timer") in found, "the timer's schedule no longer holds its entries' args"
    assert ("running", "running") in found, "celery.worker.state.active_requests changed"


def test_no_process_free_reads_the_pools_size_and_the_requests_held() -> None:
    """no_process_free: reserved_requests and active_requests are sets of the requests
    received and running; the pool's size is ``num_processes`` (or the autoscaler's max)."""
    consumer = SimpleNamespace(controller=SimpleNamespace(max_concurrency=None), pool=SimpleNamespace(num_processes=2))
    class Held:  # (the sets may hold weak references)
        def __init__(self, i: int) -> None:
            self.id = f"r{i}"

    made = [Held(i) for i in range(3)]
    try:
        worker_state.reserved_requests.update(made[:2])
        worker_state.active_requests.update(made[:2])
        # (both processes running, nothing waiting: the task a body's end released starts there)
        assert not internals.no_process_free(consumer)
        assert internals.processes_idle(consumer) == 0  # (the releaser hands nothing here)
        worker_state.reserved_requests.add(made[2])
        assert internals.no_process_free(consumer)  # (one waits already)
        worker_state.active_requests.discard(made[1])
        # (one process free, one waiting for it)
        assert internals.no_process_free(consumer)
        consumer.controller.max_concurrency = 4  # (an autoscaler's ceiling: 3 free, 2 waiting)
        assert not internals.no_process_free(consumer)
        assert internals.processes_idle(consumer) == 1
    finally:
        worker_state.reserved_requests.difference_update(made)
        worker_state.active_requests.difference_update(made)
