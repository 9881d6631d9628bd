"""The engine's HTTP/1.1 client against real servers on loopback: kept connections, both
directions streamed with backpressure, and how its failures reach the engine."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from capabilities.engine.http1 import READ_CHUNK, Http1Pool
from capabilities.engine.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from sigil.ports import free_port

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def run(coroutine):
    return asyncio.run(coroutine)


async def serving(handler, **runner_options) -> tuple[web.AppRunner, str, list]:
    """An aiohttp server answering every path with `handler`; the list gathers the client
    address of every request, so a test sees which connection each came on."""
    peers: list = []

    async def recorded(request: web.Request):
        peers.append(request.transport.get_extra_info("peername"))
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorded)
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", peers


async def body_of(pool: Http1Pool, connection) -> bytes:
    chunks = []
    while chunk := await connection.read_chunk(pool.read_timeout):
        chunks.append(chunk)
    pool.release(connection)
    return b"".join(chunks)


def test_requests_reuse_one_kept_connection_and_a_head_answer_has_no_body():
    async def answer(request: web.Request):
        return web.Response(text=f"{request.method} {request.path_qs}", headers={"X-Seen": "1"})

    async def scenario():
        runner, base, peers = await serving(answer)
        pool = Http1Pool(connect_timeout=2, read_timeout=5)
        try:
            bodies = []
            for path in ("/a", "/b?x=1", "/c"):
                connection = await pool.request("GET", base + path, {}, None)
                assert connection.status == 200 and (b"X-Seen", b"1") in connection.raw_headers
                bodies.append(await body_of(pool, connection))
            head = await pool.request("HEAD", base + "/d", {}, None)
            assert head.status == 200 and await body_of(pool, head) == b""
            after = await pool.request("GET", base + "/e", {}, None)
            bodies.append(await body_of(pool, after))
            return bodies, peers
        finally:
            pool.close()
            await runner.cleanup()

    bodies, peers = run(scenario())
    assert bodies == [b"GET /a", b"GET /b?x=1", b"GET /c", b"GET /e"]
    assert len(set(peers)) == 1, peers


def test_a_streamed_upload_reaches_the_server_before_its_end():
    async def first_chunk_back(request: web.Request):
        first = await request.content.readany()
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"got " + first)
        rest = await request.content.read()
        await response.write(b" then %d more" % len(rest))
        await response.write_eof()
        return response

    async def scenario():
        runner, base, _ = await serving(first_chunk_back)
        pool = Http1Pool(connect_timeout=2, read_timeout=5)
        answered = asyncio.Event()

        async def upload():
            yield b"first"
            await answered.wait()  # the rest only once the server answered the first part
            yield b"x" * 100_000

        try:
            connection = await pool.request("POST", base + "/", {}, upload())
            first = await connection.read_chunk(5)
            answered.set()
            return first + await body_of(pool, connection)
        finally:
            pool.close()
            await runner.cleanup()

    assert run(scenario()) == b"got first then 100000 more"


def test_a_large_answer_is_read_only_as_fast_as_it_is_consumed():
    size = 16 * 1024 * 1024

    async def large(request: web.Request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(size // READ_CHUNK):
            await response.write(b"y" * READ_CHUNK)
        await response.write_eof()
        return response

    async def scenario():
        runner, base, _ = await serving(large)
        pool = Http1Pool(connect_timeout=2, read_timeout=5)
        try:
            connection = await pool.request("GET", base + "/", {}, None)
            await asyncio.sleep(0.5)  # nothing consumed: the socket is not read meanwhile
            held = connection.buffered
            return held, len(await body_of(pool, connection))
        finally:
            pool.close()
            await runner.cleanup()

    held, total = run(scenario())
    # At most one socket read beyond the bound: asyncio reads up to 256 KiB at a time.
    assert 0 < held <= READ_CHUNK + 256 * 1024
    assert total == size


def test_a_kept_connection_the_server_closed_is_replaced_without_failing_the_request():
    async def answer(request: web.Request):
        return web.Response(text="fine")

    async def scenario():
        runner, base, peers = await serving(answer, keepalive_timeout=0.2)
        pool = Http1Pool(connect_timeout=2, read_timeout=5)
        try:
            first = await body_of(pool, await pool.request("GET", base + "/", {}, None))
            await asyncio.sleep(0.6)  # the server drops the idle connection
            second = await body_of(pool, await pool.request("PUT", base + "/", {}, b"again"))
            return first, second, peers
        finally:
            pool.close()
            await runner.cleanup()

    first, second, peers = run(scenario())
    assert first == second == b"fine"
    assert len(set(peers)) == 2


def test_an_answer_that_ends_with_its_connection_is_read_whole():
    async def scenario():
        async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nno length, ")
            await writer.drain()
            writer.write(b"ends at the close")
            writer.close()

        server = await asyncio.start_server(close_delimited, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(connect_timeout=2, read_timeout=5)
        try:
            connection = await pool.request("GET", f"http://127.0.0.1:{port}/", {}, None)
            body = await body_of(pool, connection)
            return body, connection.closed
        finally:
            pool.close()
            server.close()

    assert run(scenario()) == (b"no length, ends at the close", True)


def test_silence_is_a_timeout_a_refused_connection_unreachable_and_a_body_error_its_own():
    async def silent(request: web.Request):
        await asyncio.sleep(10)
        return web.Response(text="too late")

    class Refused(Exception):
        pass

    async def failing_upload():
        yield b"part"
        raise Refused("the caller sent too much")

    async def scenario():
        runner, base, _ = await serving(silent)
        client = UpstreamClient(connect_timeout=2, read_timeout=0.3)
        try:
            with pytest.raises(UpstreamTimeout):
                await client.request("GET", base + "/", headers={}, body=None)
            with pytest.raises(Refused):
                await client.request("POST", base + "/", headers={}, body=failing_upload())
            with pytest.raises(UpstreamUnreachable, match="connection failed"):
                await client.request("GET", f"http://127.0.0.1:{free_port()}/", headers={}, body=None)
        finally:
            await client.close()
            await runner.cleanup()

    run(scenario())
