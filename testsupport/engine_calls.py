"""Calls made to the engine itself, in an event loop of the test's own, and the SQL they run."""

from __future__ import annotations

import asyncio
import contextlib

from capabilities.engine.values import CallRequest


def call_request(agent, path: str, *, method: str = "GET", headers: dict | None = None, **fields) -> CallRequest:
    """A CallRequest from `agent` (an AgentClient) for `path` (/agent/name[/rest])."""
    owner, name, *rest = path.lstrip("/").split("/")
    return CallRequest(
        agent=owner,
        name=name,
        rest="/" + "/".join(rest),
        method=method,
        query="",
        headers={"authorization": f"Bearer {agent.invoke_token}", "host": "127.0.0.1", **(headers or {})},
        request_id="0123456789abcdef",
        **fields,
    )


def answers(*batches: list[CallRequest], between=None) -> list[list[tuple[int, dict, bytes]]]:
    """Each batch's calls in turn on one engine: (status, headers, body) of each; `between`
    runs after each batch but the last (in the test's thread)."""
    from capabilities.engine.engine import Engine

    async def run():
        engine = Engine()
        results = []
        try:
            for index, batch in enumerate(batches):
                outcome = []
                for request in batch:
                    answer = await engine.call(request)
                    body = b"".join([chunk async for chunk in answer.chunks()])
                    await answer.close()
                    outcome.append((answer.status, dict(answer.headers), body))
                results.append(outcome)
                if between is not None and index + 1 < len(batches):
                    between(index)
        finally:
            await engine.aclose()
        return results

    return asyncio.run(run())


def answers_together(batch: list[CallRequest]) -> list[tuple[int, dict, bytes]]:
    """The batch's calls all at once on one engine, each step of theirs in lockstep (as calls
    that arrive together are): (status, headers, body) of each."""
    from capabilities.engine.engine import Engine

    async def one(engine, request):
        answer = await engine.call(request)
        body = b"".join([chunk async for chunk in answer.chunks()])
        await answer.close()
        return answer.status, dict(answer.headers), body

    async def run():
        engine = Engine()
        try:
            return await asyncio.gather(*(one(engine, request) for request in batch))
        finally:
            await engine.aclose()

    return asyncio.run(run())


@contextlib.contextmanager
def sql_counted(queries: list[str]):
    """Append to `queries` every SQL statement run while the block runs, on any thread's
    database connection (the engine's pool opens its own)."""
    from django.db import connection
    from django.db.backends.signals import connection_created

    def counted(execute, sql, *rest):
        queries.append(sql)
        return execute(sql, *rest)

    def wrap(sender, connection, **kwargs):
        connection.execute_wrappers.append(counted)

    connection_created.connect(wrap)
    try:
        with connection.execute_wrapper(counted):
            yield queries
    finally:
        connection_created.disconnect(wrap)
