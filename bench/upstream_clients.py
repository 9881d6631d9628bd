"""Upstream clients benchmark: what each asyncio HTTP client costs the engine per call.

    .venv/bin/python bench/upstream_clients.py [--calls 20000] [--concurrency 16]

The engine's upstream calls are plain keep-alive HTTP/1.1 requests to a runtime on loopback.
This starts a small HTTP server in a process of its own (uvicorn with a bare ASGI app that
answers 23 bytes, so its cost is not the client's), then for each client makes `--calls`
GETs, `--concurrency` at a time over keep-alive connections, and prints the client process's
CPU time per call and its calls per second: the engine's own (capabilities/engine/http1.py,
through UpstreamClient as the engine calls it), aiohttp, httpx (on httpcore), and a
bare client on asyncio streams that writes the request and reads the answer by its
Content-Length (no pool, no parsing beyond that: a floor, not a usable client).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import httpx
from harness import client_cost, options

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capabilities.engine.upstream import UpstreamClient
from sigil.ports import free_port

APP = textwrap.dedent(
    """
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"23")]})
        await send({"type": "http.response.body", "body": b"hello from a capability"})
    """
)


async def with_engine_client(url: str, calls: int, concurrency: int) -> None:
    client = UpstreamClient(connect_timeout=5.0, read_timeout=30.0)

    async def worker(n: int) -> None:
        for _ in range(n):
            response = await client.request("GET", url, headers={}, body=None)
            await response.read()
            response.release()

    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    await client.close()


async def with_aiohttp(url: str, calls: int, concurrency: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.get(url) as response:
                    await response.read()

        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


async def with_httpx(url: str, calls: int, concurrency: int) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker(n: int) -> None:
            for _ in range(n):
                response = await client.get(url)
                response.read()

        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


async def with_streams(url: str, calls: int, concurrency: int) -> None:
    host, port = url.split("//")[1].split("/")[0].split(":")
    request = f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()

    async def worker(n: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        for _ in range(n):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()

    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


CLIENTS = {
    "sigil http1 (the engine's)": with_engine_client,
    "aiohttp": with_aiohttp,
    "httpx": with_httpx,
    "asyncio streams (floor)": with_streams,
}


def main() -> int:
    args = options(__doc__, calls=20000, concurrency=16, rounds=3)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    folder = Path(tempfile.mkdtemp(prefix="sigil-upstream-"))
    (folder / "target.py").write_text(APP)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "target:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(folder)},
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 20
        while True:
            try:
                asyncio.run(with_streams(url, 1, 1))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        print(f"{args.calls} calls, {args.concurrency} at a time, {args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
        print(f"{'client':26} {'CPU µs/call':>12} {'calls/s':>10}")
        runner = uvloop.run if uvloop else asyncio.run

        def run(client) -> None:
            runner(client(url, args.calls, args.concurrency))

        for name, client in CLIENTS.items():
            cpu, rate = client_cost(run, client, calls=args.calls, rounds=args.rounds)
            print(f"{name:26} {cpu:12.0f} {rate:10.0f}")
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
