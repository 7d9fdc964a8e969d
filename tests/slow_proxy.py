"""A TCP proxy that delays both ways, and may lose replies: a store on a slow or bad link,
for the tests.

``python -m tests.slow_proxy LISTEN_PORT TARGET_PORT DELAY_MS [LOSE SEED]``: each chunk
reaches the other side DELAY_MS / 2 later, in order, each way. So every round trip to the
store takes DELAY_MS more, half of it on the way there, as across a slow network or a far
region. With LOSE (0 to 1), each chunk of a reply is, with that chance, never delivered:
the connection is cut both ways instead, after the server ran what it was sent (a reply
lost on a dropped link: the caller cannot tell whether its command ran). SEED makes the
losses repeatable. It prints "ready" once it listens.

SIGUSR1 cuts replication through it: a replica that replicates from this proxy (its
connection sent REPLCONF) is cut off, and every such connection after it, while every
other client goes on: the primary acknowledges writes that its replica never gets. (A
Sentinel that monitors the primary at this proxy's address sees the replica pointed at its
master, and leaves it so.)
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

#: Set by SIGUSR1: replication through this proxy is cut.
_CUT = {"replication": False}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                lose: float = 0.0, rng: random.Random | None = None, link: dict[str, bool] | None = None) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(due - loop.time(), 0))
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(65536):
            if link is not None and b"REPLCONF" in data.upper():
                link["replica"] = True
            if link is not None and link.get("replica") and _CUT["replication"]:
                sender.cancel()
                writer.transport.abort()
                break
            if lose and rng is not None and rng.random() < lose:
                sender.cancel()
                writer.transport.abort()  # (the reply never arrives: the link dropped)
                break
            queue.put_nowait((loop.time() + delay, data))
    finally:
        queue.put_nowait((loop.time() + delay, b""))
        await asyncio.gather(sender, return_exceptions=True)


async def main(listen: int, target: int, delay_ms: float, lose: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        one_way, link = delay_ms / 2000, {"replica": False}
        await asyncio.gather(_pipe(client_reader, upstream_writer, one_way, link=link),
                             _pipe(upstream_reader, client_writer, one_way, lose, rng, link), return_exceptions=True)
        upstream_writer.transport.abort()
        client_writer.transport.abort()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: _CUT.update(replication=True))
    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def spawn(target_port: int, delay_ms: float, lose: float = 0.0, seed: int = 0,
          port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    """This proxy in a process of its own, in front of the Redis at ``target_port``, once
    it listens (on ``port``, else a free one): (the process, the port it listens on)."""
    if not port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "tests.slow_proxy", str(port), str(target_port), str(delay_ms),
                             str(lose), str(seed)],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc, port


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                     *(float(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else ()))
