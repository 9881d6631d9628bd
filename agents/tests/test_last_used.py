"""A token's "last used" counts every authenticated use: the REST API and MCP as well as
calls through the gateway, stamped at most once a minute per token and process."""

from agents import tokens
from agents.models import Token
from capabilities import tasks
from capabilities.tests.test_mcp import all_tools, run
from sigil import redis_keys
from testsupport.capability_code import PONG


def last_used(agent: str, scope: str):
    return Token.objects.get(agent__name=agent, scope=scope).last_used_at


def test_a_token_used_only_on_the_api_or_over_mcp_shows_when(sigil, alice, bob):
    assert last_used("alice", "deploy") is None and last_used("bob", "invoke") is None
    alice.deploy(name="ping", code=PONG)  # the deploy token, on the REST API only
    run(sigil, bob.invoke_token, "2026-07-28", all_tools)  # bob's invoke token, on /_mcp only

    tasks.capability_flush_stats()
    assert last_used("alice", "deploy") is not None
    assert last_used("bob", "invoke") is not None
    assert last_used("bob", "deploy") is None  # unused tokens stay "never"


def test_a_token_is_stamped_at_most_once_a_minute(sigil, alice, redis_client):
    token_hash = tokens.hash_secret(alice.deploy_token)
    assert alice.call("/_api/capabilities", token="deploy").status_code == 200
    first = redis_client.hget(redis_keys.TOKENS_USED, token_hash)
    assert first is not None

    redis_client.delete(redis_keys.TOKENS_USED)  # as a flush would
    for _ in range(3):
        assert alice.call("/_api/capabilities", token="deploy").status_code == 200
    assert redis_client.hget(redis_keys.TOKENS_USED, token_hash) is None  # no Redis write within the minute

    tokens._stamped_at[token_hash] -= tokens.STAMP_INTERVAL_SECONDS  # a minute later
    assert alice.call("/_api/capabilities", token="deploy").status_code == 200
    assert float(redis_client.hget(redis_keys.TOKENS_USED, token_hash)) > float(first)
