"""The warm call's pipelined Redis connection, against real Redis servers: its replies are
redis-py's, concurrent commands each get their own, and its failures are redis-py's."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis
from django.conf import settings

from sigil.embedded_redis import EmbeddedRedis
from sigil.pipelined_redis import PipelinedRedis

SCRIPT = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1, redis.call('GET', KEYS[1])}"


def run(coroutine):
    return asyncio.run(coroutine)


def test_replies_are_as_redis_py_gives_them(redis_client):
    redis_client.set("a", b"\x00bytes\xff")
    redis_client.set("n", 7)
    expected_values = redis_client.mget(["a", "missing", "n"])
    expected_scripted = redis_client.eval(SCRIPT, 1, "n", "é", 41)
    client = PipelinedRedis(settings.REDIS_URL, timeout=5)

    async def commands():
        try:
            return (
                await client.mget(["a", "missing", "n"]),
                await client.run_script(SCRIPT, ["n"], ["é", 41]),
                await client.execute("INCRBY", "n", 3),
            )
        finally:
            await client.aclose()

    values, scripted, incremented = run(commands())
    assert values == expected_values == [b"\x00bytes\xff", None, b"7"]
    assert scripted == expected_scripted == [b"n", "é".encode(), 42, b"7"]
    assert incremented == 10


def test_a_script_redis_forgot_is_loaded_again(redis_client):
    redis_client.set("k", "v")
    client = PipelinedRedis(settings.REDIS_URL, timeout=5)

    async def twice():
        try:
            first = await client.run_script(SCRIPT, ["k"], ["x", 1])
            redis_client.script_flush()  # as a restarted Redis has forgotten it
            return first, await client.run_script(SCRIPT, ["k"], ["x", 1])
        finally:
            await client.aclose()

    first, again = run(twice())
    assert first == again == [b"k", b"x", 2, b"v"]


def test_concurrent_commands_each_get_their_own_reply(redis_client):
    redis_client.mset({f"key:{n}": f"value:{n}" for n in range(500)})
    client = PipelinedRedis(settings.REDIS_URL, timeout=5)

    async def many():
        try:
            return await asyncio.gather(*(client.mget([f"key:{n}", f"key:{n + 1}"]) for n in range(499)))
        finally:
            await client.aclose()

    replies = run(many())
    assert replies == [[f"value:{n}".encode(), f"value:{n + 1}".encode()] for n in range(499)]


def test_an_error_reply_is_a_response_error_and_the_connection_goes_on(redis_client):
    redis_client.set("text", "not a number")
    client = PipelinedRedis(settings.REDIS_URL, timeout=5)

    async def commands():
        try:
            with pytest.raises(redis.ResponseError, match="not an integer"):
                await client.execute("INCR", "text")
            return await client.execute("GET", "text")
        finally:
            await client.aclose()

    assert run(commands()) == b"not a number"


def test_the_url_names_the_database_and_the_password(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", durable=False)
    server.start()
    try:
        redis.Redis(unix_socket_path=str(server.socket_path)).config_set("requirepass", "s3cret")
        writer = redis.Redis(unix_socket_path=str(server.socket_path), password="s3cret", db=3)
        writer.set("where", "db 3")
        right = PipelinedRedis(f"unix://:s3cret@{server.socket_path}?db=3", timeout=5)
        wrong = PipelinedRedis(f"unix://:nope@{server.socket_path}?db=3", timeout=5)

        async def read():
            try:
                value = await right.execute("GET", "where")
                with pytest.raises(redis.AuthenticationError):
                    await wrong.execute("GET", "where")
                return value
            finally:
                await right.aclose()
                await wrong.aclose()

        assert run(read()) == b"db 3"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_redis_that_stops_answering_times_out_and_one_that_went_away_is_reconnected(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", durable=False)
    server.start()
    client = PipelinedRedis(server.url, timeout=0.5)

    async def through_outages():
        try:
            assert await client.execute("SET", "k", "v") == b"OK"
            os.kill(server.process.pid, signal.SIGSTOP)  # it still holds the socket, never answers
            try:
                with pytest.raises(redis.TimeoutError):
                    await client.execute("GET", "k")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert await client.execute("GET", "k") == b"v"  # a new connection

            server.stop()
            with pytest.raises(redis.ConnectionError):
                await client.execute("GET", "k")
            server.start()
            return await client.execute("GET", "k")  # empty: it kept nothing
        finally:
            await client.aclose()

    try:
        assert run(through_outages()) is None
    finally:
        server.stop()
