"""`/`, the first URL runsigil's banner prints: a browser lands in the owner's console, any
other client gets an index of where things are, each of which answers."""

import requests


def test_a_browser_is_sent_to_the_admin(sigil):
    browser = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    answer = requests.get(f"{sigil.url}/", headers=browser, allow_redirects=False, timeout=10)
    assert answer.status_code == 302 and answer.headers["Location"] == "/admin/"


def test_an_api_client_gets_an_index_whose_links_answer(sigil, alice):
    answer = requests.get(f"{sigil.url}/", timeout=10)  # requests, as curl, sends Accept: */*
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
    index = answer.json()
    assert index["calls"] == f"{sigil.url}/{{agent}}/{{capability}}"
    for name in ("schema", "docs", "llms_txt", "health", "admin"):
        assert requests.get(index[name], timeout=10).status_code == 200, name
    mcp = requests.post(
        index["mcp"],
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        },
        headers={
            "Authorization": f"Bearer {alice.invoke_token}",
            "Accept": "application/json, text/event-stream",
        },
        timeout=10,
    )
    assert mcp.status_code == 200, mcp.text
