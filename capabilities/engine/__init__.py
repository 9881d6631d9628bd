"""The event-driven call path: a CallRequest in, a CallAnswer out (engine.Engine), with its
ASGI edge (adapter), WebSockets (websocket), each agent's fair share (shares), the upstream
client (upstream) and the runners of accepted asynchronous calls (runner)."""
