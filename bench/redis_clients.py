"""Redis clients benchmark: what the warm call's two Redis commands cost the engine's process.

    .venv/bin/python bench/redis_clients.py [--calls 20000] [--concurrency 16] [--rounds 3]

A warm call sends an MGET of four keys before it is forwarded and one script call after.
This sends that pair `--calls` times, `--concurrency` calls at a time, on one event loop,
through redis-py's asyncio client (with hiredis) and through the engine's pipelined
connection (sigil/pipelined_redis.py), and prints the client process's CPU time per pair and
the pairs per second. It uses the Redis at REDIS_URL, or starts the bundled one, and touches
only its own keys (redis_keys.bench).
"""

from __future__ import annotations

import asyncio
import os
import sys

import redis.asyncio as aioredis
import uvloop
from harness import client_cost, fresh_var_dir, options

from sigil import redis_keys
from sigil.embedded_redis import EmbeddedRedis
from sigil.pipelined_redis import PipelinedRedis

KEYS = [redis_keys.bench(name) for name in ("token", "route", "breaker", "failures")]
SCRIPT = "redis.call('HINCRBY', KEYS[1], 'calls', 1) return 0"
COUNTER = redis_keys.bench("counter")


async def with_redis_py(url: str, calls: int, concurrency: int) -> None:
    client = aioredis.Redis.from_url(url)
    script = client.register_script(SCRIPT)

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.mget(KEYS)
            await script(keys=[COUNTER], args=[1])

    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    await client.aclose()


async def with_pipelined(url: str, calls: int, concurrency: int) -> None:
    client = PipelinedRedis(url, timeout=5)

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.mget(KEYS)
            await client.run_script(SCRIPT, [COUNTER], [1])

    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    await client.aclose()


CLIENTS = {"redis-py asyncio (hiredis)": with_redis_py, "sigil pipelined (the engine's)": with_pipelined}


def main() -> int:
    args = options(__doc__, calls=20000, concurrency=16, rounds=3)
    embedded = None
    url = os.environ.get("REDIS_URL")
    if not url:
        embedded = EmbeddedRedis(fresh_var_dir("redis-clients"), durable=False)
        embedded.start()
        url = embedded.url
    try:
        print(f"{args.calls} MGET + script pairs, {args.concurrency} at a time, {args.rounds} rounds; {url}")
        print(f"{'client':32} {'CPU µs/pair':>12} {'pairs/s':>10}")

        def run(client) -> None:
            uvloop.run(client(url, args.calls, args.concurrency))

        for name, client in CLIENTS.items():
            cpu, rate = client_cost(run, client, calls=args.calls, rounds=args.rounds)
            print(f"{name:32} {cpu:12.0f} {rate:10.0f}")
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
