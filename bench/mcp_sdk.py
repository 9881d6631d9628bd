"""MCP on Sigil's own protocol code against the official SDK's server: the same tools/call and
tools/list through each, and the web worker's resident memory.

    .venv/bin/python bench/mcp_sdk.py [--rounds 20] [--batch 25] [--lists 30]

It starts on 127.0.0.1, in a fresh temporary var directory, the bundled Redis, a migrated
SQLite database and workerd (the local runtime, supervised in this process), and two Sigils
on them under granian (one worker each, as bench/mcp.py runs one):

- `ours`: the application as shipped (`sigil_site.asgi:application`), `/_mcp` on
  capabilities/mcp/endpoint.py;
- `sdk`: the same application with `/_mcp` on the official SDK's `StreamableHTTPSessionManager`
  (stateless, JSON answers) whose tools/list and tools/call handlers are Sigil's own
  (bench/mcp_sdk_server.py): only the protocol layer differs.

Both get the same raw HTTP requests, as the official client sends them in the stateless
revision (2026-07-28), over one keep-alive connection each, interleaved in rounds (the order
turning) so that drift and other load hit both alike: a tools/call of a capability with an
input and an output schema, then the whole tools/list (six pages) of an agent that may call
500 capabilities with contracts and Sigil's own tools, and the tools/call again with those
listed. Prints p50 and p90 of each, the server's CPU per request, and each worker's resident
memory when idle, after the calls and after the listings. `--sdk-defaults 1` adds a third
server, the SDK's as it comes (see bench/mcp_sdk_server.py). Then it sends both the requests
capabilities/tests/test_mcp.py sends by hand (errors, refusals, a session) and prints where
their answers differ.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness import Processes, fresh_var_dir, load_average, options, setup_django_here, workerd_in_thread
from invoke import cpu_seconds

# bench/mcp.py (this directory comes first on sys.path), not the SDK's package.
from mcp import ARGUMENTS, CODE, CONTRACT, LISTED, add_registry_rows, request, rpc, stateless_headers

from testsupport.processes import resident_mb
from testsupport.servers import server_command

# Each application's granian target (a factory's after --factory).
APPLICATIONS = {
    "ours": ["sigil_site.asgi:application"],
    "sdk": ["--factory", "bench.mcp_sdk_server:application"],
    "sdk-defaults": ["--factory", "bench.mcp_sdk_server:application_with_sdk_defaults"],
}


def main() -> int:
    args = options(
        __doc__,
        rounds=20,
        batch=25,
        lists=(30, "full tool listings each, in rounds of 5"),
        sdk_defaults=(0, "1: also the SDK's server as it comes (sdk-defaults)"),
    )
    from sigil.ports import free_port, free_port_block, port_is_open

    var_dir = fresh_var_dir("mcp-sdk")
    embedded = setup_django_here(var_dir, SIGIL_WORKERD_PORT=str(free_port_block()))
    from agents import services as agent_services
    from capabilities.models import Capability, CapabilityVersion

    print(f"var dir {var_dir}; load average {load_average()}")
    stop_workerd = workerd_in_thread()
    try:
        with Processes() as processes:
            agent = agent_services.agent_create(name="bench", actor="owner:bench")
            _, token = agent_services.token_issue(agent=agent, scope="deploy", actor="owner:bench")
            servers = {}
            for label, target in APPLICATIONS.items():
                if label == "sdk-defaults" and not args.sdk_defaults:
                    continue
                port = free_port()
                command = [*server_command("granian", port=port, workers=1)[:-1], *target]
                process = processes.start(command, env=dict(os.environ), log=var_dir / f"{label}.log")
                servers[label] = Server(label, port, process)
            for server in servers.values():
                server.wait_listening(port_is_open)
            auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            status, body = request(
                servers["ours"].connect(), "/_api/deploy", {"name": "add", "code": CODE, **CONTRACT}, auth
            )
            if status != 201:
                raise RuntimeError(f"deploy: {status} {body[:300]!r}")
            idle = {label: server.worker_mb() for label, server in servers.items()}

            call_headers = {**auth, **stateless_headers("tools/call"), "Mcp-Name": "bench--add"}
            tool_call = rpc("tools/call", {"name": "bench--add", "arguments": ARGUMENTS})
            for server in servers.values():
                for _ in range(100):  # warm the isolate, the connections and the validators
                    server.call(tool_call, call_headers)
            calls = {label: Samples() for label in servers}
            for round_number in range(args.rounds):
                for label in order(servers, round_number):
                    server = servers[label]
                    calls[label].timed(
                        server, lambda s=server: [s.call(tool_call, call_headers) for _ in range(args.batch)]
                    )
            after_calls = {label: server.worker_mb() for label, server in servers.items()}

            add_registry_rows(agent, Capability, CapabilityVersion, LISTED)
            list_headers = {**auth, **stateless_headers("tools/list")}
            for server in servers.values():
                server.list_all(list_headers)
            listings = {label: Samples() for label in servers}
            pages = servers["ours"].list_all(list_headers)[1]
            for round_number in range(max(1, args.lists // 5)):
                for label in order(servers, round_number):
                    server = servers[label]
                    listings[label].timed(server, lambda s=server: [s.list_all(list_headers)[0] for _ in range(5)])
            # The same call once the agent may call 500 more tools (sdk-defaults lists them all first).
            calls_listed = {label: Samples() for label in servers}
            for round_number in range(max(1, args.rounds // 4)):
                for label in order(servers, round_number):
                    server = servers[label]
                    calls_listed[label].timed(
                        server, lambda s=server: [s.call(tool_call, call_headers) for _ in range(args.batch)]
                    )
            after_lists = {label: server.worker_mb() for label, server in servers.items()}
            peak = {label: server.worker_peak_mb() for label, server in servers.items()}
            probes = {label: probe(server, token) for label, server in servers.items()}
    finally:
        stop_workerd()
        embedded.stop()

    print(f"load average after {load_average()}")
    count = args.rounds * args.batch
    print(f"granian, 1 worker each; {count} tools/call each, {len(listings['ours'].values)} tools/list of {pages}")
    print(f"{'':<12} {'tools/call p50':>14} {'p90':>8} {'CPU':>8}   {'tools/list p50':>14} {'p90':>8} {'CPU':>8}")
    for label in servers:
        c, lst = calls[label], listings[label]
        print(
            f"{label:<12} {c.p50:>11.3f} ms {c.p90:>8.3f} {c.cpu_us:>5.0f} µs   "
            f"{lst.p50:>11.2f} ms {lst.p90:>8.2f} {lst.cpu_us / 1000:>5.1f} ms"
        )
    print(f"tools/call again, {len(calls_listed['ours'].values)} each, the agent now with {LISTED} more tools:")
    for label in servers:
        c = calls_listed[label]
        print(f"{label:<12} {c.p50:>11.3f} ms {c.p90:>8.3f} {c.cpu_us:>5.0f} µs")
    print(f"{'':<12} {'worker RSS, MB: idle':>21} {'after calls':>12} {'after lists':>12} {'peak':>8}")
    for label in servers:
        memory = (idle[label], after_calls[label], after_lists[label], peak[label])
        print(f"{label:<12} {memory[0]:>21.1f} {memory[1]:>12.1f} {memory[2]:>12.1f} {memory[3]:>8.1f}")
    print("the requests test_mcp.py sends by hand, where the answers differ (status, JSON-RPC code or Sigil's code):")
    for (what, ours), (_, sdk) in zip(probes["ours"], probes["sdk"], strict=True):
        if ours != sdk:
            print(f"  {what}: ours {ours}, sdk {sdk}")
    return 0


def order(servers: dict, round_number: int) -> list[str]:
    """Each round starts with another server, so none is always first after a pause."""
    labels = list(servers)
    shift = round_number % len(labels)
    return labels[shift:] + labels[:shift]


class Samples:
    """Latencies (ms) of one server's requests, and the server's CPU seconds they took."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.cpu = 0.0

    def timed(self, server: Server, batch) -> None:
        before = cpu_seconds(server.process.pid)
        self.values.extend(batch())
        self.cpu += cpu_seconds(server.process.pid) - before

    @property
    def p50(self) -> float:
        return statistics.median(self.values)

    @property
    def p90(self) -> float:
        return statistics.quantiles(self.values, n=10)[-1]

    @property
    def cpu_us(self) -> float:
        return self.cpu / len(self.values) * 1e6


class Server:
    def __init__(self, label: str, port: int, process) -> None:
        self.label, self.port, self.process = label, port, process
        self.connection = None

    def wait_listening(self, port_is_open) -> None:
        deadline = time.monotonic() + 60
        while not port_is_open(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} did not listen within 60 s")
            time.sleep(0.1)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def mcp(self, message: dict, headers: dict) -> tuple[int, bytes]:
        if self.connection is None:
            self.connection = self.connect()
        return request(self.connection, "/_mcp", message, headers)

    def call(self, message: dict, headers: dict) -> float:
        started = time.perf_counter()
        status, body = self.mcp(message, headers)
        elapsed = (time.perf_counter() - started) * 1000
        result = json.loads(body).get("result", {})
        if status != 200 or result.get("structuredContent") != {"sum": 5}:
            raise RuntimeError(f"{self.label} tools/call: {status} {body[:300]!r}")
        return elapsed

    def list_all(self, headers: dict) -> tuple[float, int]:
        started = time.perf_counter()
        cursor, pages = None, 0
        while True:
            status, body = self.mcp(rpc("tools/list", {"cursor": cursor} if cursor else {}), headers)
            if status != 200:
                raise RuntimeError(f"{self.label} tools/list: {status} {body[:300]!r}")
            result = json.loads(body)["result"]
            pages += 1
            cursor = result.get("nextCursor")
            if cursor is None:
                return (time.perf_counter() - started) * 1000, pages

    def worker(self) -> int:
        """granian's worker: the one child of its main process."""
        return int(Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()[0])

    def worker_mb(self) -> float:
        return resident_mb(self.worker())

    def worker_peak_mb(self) -> float:
        status = Path(f"/proc/{self.worker()}/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


MODERN = {"MCP-Protocol-Version": "2026-07-28"}
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


def probe(server: Server, token: str) -> list[tuple[str, tuple]]:
    """What `server` answers to the requests test_mcp.py sends without the official client:
    (what, (status, JSON-RPC error code or result keys, Sigil's code or session header))."""

    def send(body, headers, method="POST") -> tuple:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        # What requests sends, as test_mcp.py's raw requests do (Accept: */*).
        all_headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Accept": "*/*",
            **headers,
        }
        all_headers = {name: value for name, value in all_headers.items() if value is not None}
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request(method, "/_mcp", body=raw if method == "POST" else None, headers=all_headers)
        response = connection.getresponse()
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            connection.close()  # a stream of server messages, kept open: nothing more to read
            return response.status, "an event stream", None
        data = response.read()
        connection.close()
        try:
            answer = json.loads(data)
        except ValueError:
            return response.status, data[:40].decode(errors="replace"), response.getheader("Mcp-Session-Id")
        error = answer.get("error") if isinstance(answer, dict) else None
        if error is not None:
            return (
                response.status,
                error.get("code"),
                (error.get("data") or {}).get("code") if isinstance(error.get("data"), dict) else error.get("data"),
            )
        return response.status, sorted(answer.get("result", {})), response.getheader("Mcp-Session-Id") is not None

    def listing(meta=META, **extra) -> dict:
        return {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta, **extra}}

    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    results = [
        ("body not JSON", send(b"{not json", MODERN)),
        ("a batch", send([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}], MODERN)),
        ("jsonrpc 1.0", send({"jsonrpc": "1.0", "id": 1, "method": "tools/list"}, MODERN)),
        ("id null", send({"jsonrpc": "2.0", "id": None, "method": "tools/list"}, MODERN)),
        ("no _meta", send({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}, MODERN)),
        ("Mcp-Method disagrees", send(listing(), {**MODERN, "Mcp-Method": "tools/call"})),
        ("unknown method", send({**listing(), "method": "no/such"}, {**MODERN, "Mcp-Method": "no/such"})),
        ("ping (gone in 2026-07-28)", send({**listing(), "method": "ping"}, {**MODERN, "Mcp-Method": "ping"})),
        (
            "version 2099-01-01",
            send(
                listing({**META, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}),
                {"MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "tools/list"},
            ),
        ),
        ("a cursor not given", send(listing(cursor="%%%"), {**MODERN, "Mcp-Method": "tools/list"})),
        (
            "server/discover",
            send({**listing(), "method": "server/discover"}, {**MODERN, "Mcp-Method": "server/discover"}),
        ),
        ("no token", send({}, {"Authorization": ""})),
        ("GET", send(b"", {}, method="GET")),
        ("a form", send(b"a=b", {"Content-Type": "application/x-www-form-urlencoded"})),
        ("initialize 2025-06-18", send(initialize, {})),
        ("no Accept header", send(listing(), {**MODERN, "Mcp-Method": "tools/list", "Accept": None})),
        ("ping without a session", send({"jsonrpc": "2.0", "id": 2, "method": "ping"}, {})),
    ]
    return results


if __name__ == "__main__":
    sys.exit(main())
