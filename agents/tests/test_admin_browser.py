"""The owner's console for agents and tokens, driven in Chromium against a live Sigil."""

import requests

from agents.models import Agent, AuditEvent, Token
from testsupport.browser import screenshot
from testsupport.cast import AgentClient, wait_for

PONG = 'export default { fetch() { return new Response("pong") } }'


def list_capabilities(base_url: str, secret: str) -> requests.Response:
    return requests.get(f"{base_url}/_api/capabilities", headers={"Authorization": f"Bearer {secret}"}, timeout=10)


def test_owner_creates_an_agent_and_a_token_reads_it_once_uses_it_and_revokes_it(sigil, owner):
    page = owner
    page.goto(f"{sigil.url}/admin/")
    screenshot(page, "index")
    page.goto(f"{sigil.url}/admin/agents/agent/add/")
    page.fill("#id_name", "carol")
    page.click("input[name=_continue]")
    # The agent comes with its two tokens, shown once, as createagent prints them.
    page.get_by_text("An invoke token for carol").wait_for()
    page.get_by_text("A deploy token for carol").wait_for()
    carol = Agent.objects.get(name="carol")
    assert AuditEvent.objects.filter(action="agent.created", subject="carol", actor="owner:owner").exists()
    shown = {"deploy": page.input_value("#token-secret-deploy"), "invoke": page.input_value("#token-secret-invoke")}
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click("#copy-token-invoke")
    page.locator("#copy-result-invoke", has_text="Copied.").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == shown["invoke"]
    screenshot(page, "agents-agent-created-with-tokens")
    carol_agent = AgentClient("carol", shown["deploy"], shown["invoke"], sigil.url)
    assert carol_agent.deploy(name="ping", code=PONG).status_code == 201
    answered = carol_agent.call("/carol/ping")
    assert (answered.status_code, answered.text) == (200, "pong")
    page.reload()
    page.locator("#secret-gone").wait_for()
    assert not any(secret in page.content() for secret in shown.values())
    page.click("#agent-created-done")

    page.click("text=Issue a token")
    assert page.input_value("#id_agent") == str(carol.pk)
    page.select_option("#id_scope", "deploy")
    page.fill("#id_label", "from the browser")
    page.click("input[name=_save]")
    secret = page.input_value("#token-secret")
    assert secret.startswith("sgl_")
    page.click("#copy-token")
    page.get_by_text("Copied.").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == secret
    screenshot(page, "agents-token-issued-once")
    page.reload()  # the page after the redirect: reloading it issues nothing, and shows nothing
    page.locator("#secret-gone").wait_for()
    assert secret not in page.content() and Token.objects.filter(agent=carol).count() == 3

    token = Token.objects.get(agent=carol, label="from the browser")
    assert secret not in (token.prefix, token.secret_hash) and token.prefix == secret[:12]
    assert list_capabilities(sigil.url, secret).status_code == 200

    page.click("text=Done")
    page.get_by_text("Revoke this token").wait_for()
    assert secret not in page.content()  # shown once, never again
    page.goto(f"{sigil.url}/admin/agents/agent/{carol.pk}/change/")
    assert secret not in page.content()
    screenshot(page, "agents-agent-page")

    page.goto(f"{sigil.url}/admin/agents/token/{token.pk}/change/")
    page.click("#revoke-token")
    page.get_by_text("Every call and deploy with it is refused").wait_for()  # asked first
    screenshot(page, "agents-token-revoke-confirmation")
    assert list_capabilities(sigil.url, secret).status_code == 200
    page.click("#confirm")
    page.get_by_text(f"Revoked token {token.prefix}").wait_for()
    screenshot(page, "agents-token-revoked")
    wait_for(lambda: list_capabilities(sigil.url, secret).status_code == 401, message="the revoked token refused")
    assert list_capabilities(sigil.url, secret).json()["error"]["code"] == "unauthenticated"

    page.goto(f"{sigil.url}/admin/agents/token/?state=revoked")
    page.get_by_text(token.prefix).wait_for()
    page.goto(f"{sigil.url}/admin/agents/auditevent/?agent_name=carol")
    page.locator("td.field-action", has_text="token.revoked").wait_for()
    screenshot(page, "agents-audit-trail")
