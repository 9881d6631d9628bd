"""Sigil's Tail Worker on a Cloudflare account (`host/tail.js`), for the runtimes whose
capabilities are Worker scripts of their own: the worker-pool runtime names it in every
script's `tail_consumers`, the platform runtime in its dispatch Worker's, whose Tail Worker
receives the user Workers' events as well (Workers for Platforms).

It leaves the calls' records in a Workers KV namespace of its own, in batches, and Sigil
takes them from there (`take`, the beat's collection task), as the loader runtime's host
does in its namespace: Cloudflare never needs to reach Sigil's server, which may sit behind
a NAT or a firewall. A batch not taken within a day expires (KV's own expiry).
"""

from __future__ import annotations

import json

from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareNotFound, NamedKv
from capabilities.runtimes.sigil_worker import SigilWorker
from capabilities.workerd.config import HOST_DIR

TAIL_WORKER = "sigil-tail"
TAIL_KV_TITLE = "sigil-call-records"
LOGS_PREFIX = "logs:"
_SOURCES = {name: (HOST_DIR / name).read_text() for name in ("tail.js", "host.js")}


class TailMailbox:
    """The Tail Worker and the KV namespace it leaves batches in; `skip` names Workers whose
    own events are no capability's (the dispatch Worker). Thread-safe."""

    def __init__(
        self, *, client: CloudflareClient, limits: dict, skip: tuple[str, ...] = (), invoke_base: str = ""
    ) -> None:
        self.client = client
        self.limits = limits
        self.skip = skip
        self.invoke_base = invoke_base
        self.consumers = [{"service": TAIL_WORKER}]
        self.kv = NamedKv(client=client, title=TAIL_KV_TITLE)
        self._worker: SigilWorker | None = None

    @property
    def kv_id(self) -> str:
        """The id of the KV namespace, created if missing."""
        return self.kv.id

    @property
    def worker(self) -> SigilWorker:
        if self._worker is None:
            self._worker = SigilWorker(
                client=self.client,
                name=TAIL_WORKER,
                modules=_SOURCES,
                main_module="tail.js",
                bindings=[
                    {"type": "kv_namespace", "name": "LOG_KV", "namespace_id": self.kv_id},
                    {"type": "plain_text", "name": "LOG_LIMITS", "text": json.dumps(self.limits)},
                    {"type": "plain_text", "name": "LOG_SLOTS", "text": "1"},
                    {"type": "plain_text", "name": "SIGIL_TAIL_SKIP", "text": json.dumps(list(self.skip))},
                ],
                secret_bindings=[],
                version_binding="SIGIL_TAIL_VERSION",
                invoke_base=self.invoke_base,
            )
        return self._worker

    def provision(self) -> list[str]:
        """Deploy the Tail Worker if it is missing or runs other code. Idempotent."""
        if self.worker.deploy():
            return [f"deployed the Tail Worker {TAIL_WORKER} ({self.worker.version})"]
        return []

    def take(self, *, limit: int) -> list[dict]:
        return kv_batches_take(self.client, self.kv_id, limit=limit)


def kv_batches_take(client: CloudflareClient, kv_id: str, *, limit: int) -> list[dict]:
    """The oldest `limit` batches of call records a tail left under `logs:` (one listing, then
    a read and a delete per batch). A batch that is not JSON is dropped and returned as
    `{"records": None}`, so that it is counted as undelivered."""
    keys = sorted(k["name"] for k in client.kv_keys(kv_id, prefix=LOGS_PREFIX))[:limit]
    batches = []
    for key in keys:
        try:
            raw = client.kv_get(kv_id, key)
        except CloudflareNotFound:
            continue  # another collector took it, or it expired meanwhile
        client.kv_delete(kv_id, key)
        try:
            batch = json.loads(raw)
        except ValueError:
            batch = {"records": None}
        batches.append(batch if isinstance(batch, dict) else {"records": None})
    return batches
