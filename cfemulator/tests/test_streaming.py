"""Bodies stream through the emulator both ways, as through Cloudflare: a Worker's answer
reaches the caller as the Worker writes it, and a request body reaches the Worker as the
caller sends it. Checked through Sigil's gateway on the worker-pool runtime, and at the
emulator's own door."""

from __future__ import annotations

import time

import pytest

from cfemulator.tests.test_api import Api

PIECES = 8
PIECE_BYTES = 640 * 1024  # 8 pieces: 5 MB in all
PAUSE_MS = 500  # between pieces: about 4 s in all

SLOW_STREAM = f"""export default {{ async fetch() {{
  const piece = new Uint8Array({PIECE_BYTES}).fill(120);
  const {{ readable, writable }} = new TransformStream();
  (async () => {{
    const writer = writable.getWriter();
    for (let i = 0; i < {PIECES}; i++) {{
      if (i) await new Promise(r => setTimeout(r, {PAUSE_MS}));
      await writer.write(piece);
    }}
    await writer.close();
  }})();
  return new Response(readable, {{ headers: {{ 'content-type': 'application/octet-stream' }} }});
}} }}"""

# How long after the request body's first piece its end arrived (workerd's clock moves on I/O).
BODY_SPAN = """export default { async fetch(request) {
  const reader = request.body.getReader();
  let first = null, total = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    first ??= Date.now();
    total += value.byteLength;
  }
  return Response.json({ total, spanMs: Date.now() - first });
} }"""


def test_a_slow_5_mb_stream_arrives_as_written_through_the_gateway(worker_pool, alice, sigil, settings):
    # Each read may wait this long; the whole stream takes longer.
    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 2.5
    sigil.app.gateway = None  # rebuilt with the timeout above
    assert alice.deploy(name="slow", code=SLOW_STREAM).status_code == 201
    assert alice.call("/alice/slow", stream=True).raw.read(1)  # paged in: its cold start is not timed

    started = time.monotonic()
    response = alice.call("/alice/slow", stream=True)
    assert response.status_code == 200, response.text
    first = response.raw.read(1)
    first_at = time.monotonic() - started
    rest = response.raw.read()
    total = time.monotonic() - started

    assert len(first) + len(rest) == PIECES * PIECE_BYTES
    assert total >= (PIECES - 1) * PAUSE_MS / 1000 * 0.9  # the Worker's own pauses
    assert first_at < total / 2, (first_at, total)  # the first byte came long before the last


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def test_a_request_body_reaches_the_worker_as_the_caller_sends_it(api: Api, cf_emulator_fresh):
    assert api.upload("body-span", BODY_SPAN).status_code == 200
    api.enable("body-span")

    def body():
        yield b"hello"
        time.sleep(1.5)  # a buffering emulator hands the Worker both pieces at once
        yield b" world"

    response = cf_emulator_fresh.worker_request(
        cf_emulator_fresh.workers_dev_host("body-span"), method="POST", data=body()
    )
    assert response.status_code == 200, response.text
    seen = response.json()
    assert seen["total"] == len(b"hello world")
    assert seen["spanMs"] >= 1000, seen
