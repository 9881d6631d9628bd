"""Capability code the tests deploy again and again."""

PONG = "export default { async fetch() { return new Response('pong') } }"
PONG2 = "export default { async fetch() { return new Response('pong v2') } }"
# Answers with what it received, and a status, headers and cookie of its own.
ECHO = """export default { async fetch(request) {
  const url = new URL(request.url);
  return Response.json({
    method: request.method, path: url.pathname, query: url.search,
    headers: Object.fromEntries(request.headers), body: await request.text(),
  }, { status: 207, headers: { 'x-echo': 'yes', 'set-cookie': 'a=b' } });
} }"""
# Fails with 500 "broken" when called with ?fail, answers "fine" otherwise.
FLAKY = """export default { async fetch(request) {
  if (new URL(request.url).searchParams.has('fail')) return new Response('broken', { status: 500 });
  return new Response('fine');
} }"""
# Answers how many bytes its request body had, read as they come.
COUNTS_BODY = """export default { async fetch(request) {
  let size = 0;
  const reader = request.body.getReader();
  for (;;) { const { done, value } = await reader.read(); if (done) break; size += value.length; }
  return new Response(String(size));
} }"""

# Its first chunk at once, its second 1.5 s later: a streamed answer.
STREAMS = """export default { async fetch() {
  const encoder = new TextEncoder();
  const stream = new ReadableStream({ async start(controller) {
    controller.enqueue(encoder.encode('first;'));
    await new Promise((resolve) => setTimeout(resolve, 1500));
    controller.enqueue(encoder.encode('second'));
    controller.close();
  } });
  return new Response(stream, { headers: { 'content-type': 'text/plain' } });
} }"""


def answering(text: str) -> str:
    """Code whose every call answers `text` (a quote-free word)."""
    return f"export default {{ async fetch() {{ return new Response('{text}') }} }}"
