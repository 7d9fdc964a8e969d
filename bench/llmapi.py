"""The fake LLM API of section 15: 60 requests and 10 000 tokens per minute per account.

A stdlib ``ThreadingHTTPServer`` on a free loopback port, run in a thread of the bench's
own process: one process and one lock, so the limit is exact and global, and the counts
are read back without a store. ``GET /v1/complete?account=A&label=L&i=I&id=T`` draws the
call's tokens (:func:`tokens`: uniform 50..450 from the call index ``I`` alone, so every
variant, and every run, sees the same sequence, and a retry of a call draws what it drew
the first time) and answers:

* 200 with ``{"tokens": n}`` if the account's sliding 60 s window of accepted calls then
  holds at most 60 requests and at most 10 000 tokens, this call included (counted at its
  arrival; the reply then waits the account's latency, 0 unless set in
  :attr:`LlmApi.latency`, as a model's generation would);
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

REQUESTS = 60
TOKENS = 10_000
WINDOW_S = 60.0
LOW, HIGH = 50, 450
#: The seed of the draw: fixed, so two runs of the section face the same calls.
SEED = "bench-llm-15"


def tokens(i: int) -> int:
    """The tokens call ``i`` uses (the API draws them; the client learns them from the reply)."""
    return random.Random(f"{SEED}:{i}").randint(LOW, HIGH)


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
    """One account's accepted calls of the last 60 s: (arrival, tokens)."""

    def __init__(self) -> None:
        self.calls: deque[tuple[float, int]] = deque()
        self.tokens = 0

    def _expire(self, now: float) -> None:
        while self.calls and self.calls[0][0] <= now - WINDOW_S:
            self.tokens -= self.calls.popleft()[1]

    def admit(self, now: float, cost: int) -> float:
        """Count the call and return 0, or return the seconds until it would fit."""
        self._expire(now)
        if len(self.calls) + 1 <= REQUESTS and self.tokens + cost <= TOKENS:
            self.calls.append((now, cost))
            self.tokens += cost
            return 0.0
        # Walk the oldest calls out until both limits have room for this one.
        count, held = len(self.calls), self.tokens
        for at, used in self.calls:
            count, held = count - 1, held - used
            if count + 1 <= REQUESTS and held + cost <= TOKENS:
                return at + WINDOW_S - now
        return WINDOW_S  # (a call over the whole limit alone: never, as HIGH < TOKENS)


class LlmApi:
    """The server, in a daemon thread; :meth:`tally` reads a label's counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: dict[str, Window] = {}
        self.tallies: dict[str, Tally] = {}
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
        cost = tokens(i)
        with self.lock:
            now = time.time()
            wait = self.windows.setdefault(account, Window()).admit(now, cost)
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
