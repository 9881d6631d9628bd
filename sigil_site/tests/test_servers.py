"""Chunked request bodies reach the control API and capabilities whole, under `make dev`'s
server and under each production server docs/operations.md names."""

import json

import pytest
import requests

from sigil.ports import free_port
from testsupport.capability_code import ECHO
from testsupport.servers import SERVERS, chunks, deploy_and_echo_chunked, served


def test_chunked_bodies_on_make_devs_server_and_the_connection_stays_usable(alice):
    with requests.Session() as session:
        deploy_and_echo_chunked(alice.base_url, alice, session)
        # The same kept-alive connection serves the next request: no chunk was left behind.
        assert session.get(f"{alice.base_url}/alice/echo", headers=alice.headers(alice.invoke_token)).status_code == 207


def test_an_oversized_chunked_deploy_is_a_413_in_the_envelope(alice, settings):
    settings.SIGIL_DEPLOY_MAX_BODY_BYTES = 1000
    body = json.dumps({"name": "echo", "code": ECHO + " " * 2000}).encode()
    response = requests.post(
        f"{alice.base_url}/_api/deploy",
        data=chunks(body, 100),
        headers={**alice.headers(alice.deploy_token), "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "too_large"


def test_a_malformed_chunked_body_is_a_400_on_make_devs_server(sigil):
    import socket

    with socket.create_connection(("127.0.0.1", int(sigil.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"POST /_api/deploy HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400"), answer


@pytest.mark.slow
@pytest.mark.parametrize("server", SERVERS)
def test_chunked_bodies_under_production_servers(alice, server, tmp_path):
    environment = {"SIGIL_DEPLOY_COOLDOWN_SECONDS": "0"}
    log = tmp_path / "server.log"
    with served(server, port=free_port(), environment=environment, log=log) as url, requests.Session() as session:
        deploy_and_echo_chunked(url, alice, session)
