"""The event-driven call path: a CallRequest in, a CallAnswer out (engine.Engine, which runs a
call through its jobs: admission, placing, sending, recording, async_entry, answers,
access_log), with its ASGI edge (adapter), WebSockets (websocket), each agent's fair share
(shares), the pool for blocking work (offload), the upstream client (upstream) and the runners
of accepted asynchronous calls (runner)."""
