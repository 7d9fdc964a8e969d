"""The fake LLM API of sections 15 and 15b: requests and tokens per sliding window per account.

A stdlib ``ThreadingHTTPServer`` on a free loopback port, run in a thread of the bench's
own process: one process and one lock, so the limit is exact and global, and the counts
are read back without a store. An account's :class:`Plan` (:attr:`LlmApi.plans`; section
15's, :data:`PLAN15`, unless set) holds its limits and its calls: ``GET
/v1/complete?account=A&label=L&i=I&id=T`` costs the tokens of call ``I``
(:meth:`Plan.tokens`: its prompt's, which the client knows, and its completion's, which it
learns from the reply; each drawn from the call index alone, so every variant, and every
run, sees the same sequence, and a retry of a call draws what it drew the first time) and
answers:

* 200 with ``{"tokens": n}`` if the account's sliding window of accepted calls then holds
  at most the plan's requests and tokens, this call included (counted at its arrival; the
  reply then waits the account's latency, 0 unless set in :attr:`LlmApi.latency`, as a
  model's generation would);
* else 429 at once, with ``Retry-After``: whole seconds until the window has room for
  this call (at least 1). A 429 counts toward neither limit.

Everything is counted per label (:class:`Tally`): requests, 429s, and each arrival's time,
status, tokens and task id.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import parse_qs, urlparse


@dataclass(frozen=True)
class Plan:
    """An account's limits (``requests`` and ``tokens`` in any ``window`` seconds) and its
    calls: call ``i`` uses :meth:`prompt` tokens (uniform over ``prompt``; the client knows
    them before the call) and :meth:`completion` tokens (uniform over ``completion``; known
    only from the reply). The seed is fixed, so two runs face the same calls."""

    requests: int
    tokens: int
    window: float
    prompt: tuple[int, int]
    completion: tuple[int, int]
    seed: str

    def prompt_tokens(self, i: int) -> int:
        low, high = self.prompt
        return random.Random(f"{self.seed}:prompt:{i}").randint(low, high) if high else 0

    def completion_tokens(self, i: int) -> int:
        return random.Random(f"{self.seed}:{i}").randint(*self.completion)

    def cost(self, i: int) -> int:
        """The tokens call ``i`` uses, as the API counts them."""
        return self.prompt_tokens(i) + self.completion_tokens(i)

    def total(self, calls: int) -> int:
        return sum(self.cost(i) for i in range(calls))


#: Section 15: 60 requests and 10 000 tokens a minute; no prompt, a reply of 50..450 tokens.
PLAN15 = Plan(60, 10_000, 60.0, prompt=(0, 0), completion=(50, 450), seed="bench-llm-15")
#: Section 15b (issue 26): 20 requests and 4 000 tokens per 10 s; a prompt of 50..250
#: tokens, a completion of 20..200 (``max_tokens`` 200: a call uses at most its prompt + 200).
PLAN26 = Plan(20, 4_000, 10.0, prompt=(50, 250), completion=(20, 200), seed="bench-llm-26")
MAX_COMPLETION = PLAN26.completion[1]


@dataclass
class Arrival:
    at: float
    status: int
    tokens: int
    task_id: str
    #: When the 200 was sent (0 for a 429).
    answered: float = 0.0


@dataclass
class Tally:
    """What the API saw of one label."""

    arrivals: list[Arrival] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.arrivals)

    @property
    def refused(self) -> int:
        return sum(1 for a in self.arrivals if a.status == 429)

    def accepted(self) -> list[Arrival]:
        return [a for a in self.arrivals if a.status == 200]


class Window:
    """One account's accepted calls of the plan's last window: (arrival, tokens)."""

    def __init__(self, plan: Plan = PLAN15) -> None:
        self.plan = plan
        self.calls: deque[tuple[float, int]] = deque()
        self.tokens = 0

    def _expire(self, now: float) -> None:
        while self.calls and self.calls[0][0] <= now - self.plan.window:
            self.tokens -= self.calls.popleft()[1]

    def admit(self, now: float, cost: int) -> float:
        """Count the call and return 0, or return the seconds until it would fit."""
        self._expire(now)
        limit = self.plan
        if len(self.calls) + 1 <= limit.requests and self.tokens + cost <= limit.tokens:
            self.calls.append((now, cost))
            self.tokens += cost
            return 0.0
        # Walk the oldest calls out until both limits have room for this one.
        count, held = len(self.calls), self.tokens
        for at, used in self.calls:
            count, held = count - 1, held - used
            if count + 1 <= limit.requests and held + cost <= limit.tokens:
                return at + limit.window - now
        return limit.window  # (a call over the whole limit alone: never, in these plans)


class LlmApi:
    """The server, in a daemon thread; :meth:`tally` reads a label's counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: dict[str, Window] = {}
        self.tallies: dict[str, Tally] = {}
        #: Each account's plan (PLAN15 unless set).
        self.plans: dict[str, Plan] = {}
        #: Seconds a 200 of an account waits before it is sent (a model generating).
        self.latency: dict[str, float] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="llm-api", daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def call(self, account: str, label: str, i: int, task_id: str) -> tuple[Arrival, float]:
        """Decide one call: its arrival, and the seconds until it would fit (0: accepted)."""
        plan = self.plans.get(account, PLAN15)
        cost = plan.cost(i)
        with self.lock:
            now = time.time()
            wait = self.windows.setdefault(account, Window(plan)).admit(now, cost)
            arrival = Arrival(now, 429 if wait else 200, cost, task_id)
            self.tallies.setdefault(label, Tally()).arrivals.append(arrival)
        return arrival, wait

    def tally(self, label: str) -> Tally:
        with self.lock:
            return Tally(list(self.tallies.get(label, Tally()).arrivals))

    def answered(self, label: str) -> set[str]:
        """Task ids that got their 200 (the reply sent)."""
        with self.lock:
            return {a.task_id for a in self.tallies.get(label, Tally()).arrivals if a.answered}


def _handler(api: LlmApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # (http.server's name)
            url = urlparse(self.path)
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path != "/v1/complete" or not {"account", "label", "i"} <= set(q):
                self._reply(404, {"error": "unknown"})
                return
            arrival, wait = api.call(q["account"], q["label"], int(q["i"]), q.get("id", "-"))
            if wait:
                self._reply(429, {"error": "rate limited"}, {"Retry-After": str(max(1, math.ceil(wait)))})
                return
            time.sleep(api.latency.get(q["account"], 0.0))
            self._reply(200, {"tokens": arrival.tokens})
            with api.lock:
                arrival.answered = time.time()

        def _reply(self, status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # (http.server's names)
            pass  # hundreds of lines a run, none of them needed

    return Handler
