"""A TCP proxy that delays both ways: a store on a slow link, for the tests.

``python -m tests.slow_proxy LISTEN_PORT TARGET_PORT DELAY_MS``: each chunk reaches the
other side DELAY_MS / 2 later, in order, each way. So every round trip to the store takes
DELAY_MS more, half of it on the way there, as across a slow network or a far region. It
prints "ready" once it listens.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
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
            queue.put_nowait((loop.time() + delay, data))
    finally:
        queue.put_nowait((loop.time() + delay, b""))
        await sender


async def main(listen: int, target: int, delay_ms: float) -> None:
    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        one_way = delay_ms / 2000
        await asyncio.gather(_pipe(client_reader, upstream_writer, one_way),
                             _pipe(upstream_reader, client_writer, one_way), return_exceptions=True)

    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def spawn(target_port: int, delay_ms: float) -> tuple[subprocess.Popen[bytes], int]:
    """This proxy in a process of its own, in front of the Redis at ``target_port``, once
    it listens: (the process, the port it listens on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "tests.slow_proxy", str(port), str(target_port), str(delay_ms)],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc, port


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
