"""Sigil's Tail Worker on a Cloudflare account (`host/tail.js`), for the runtimes whose
capabilities are Worker scripts of their own: the worker-pool runtime names it in every
script's `tail_consumers`, the platform runtime in its dispatch Worker's, whose Tail Worker
receives the user Workers' events as well (Workers for Platforms).

It pushes the calls' records to Sigil's origin (SIGIL_ORIGIN_URL) in signed batches, and keeps
in a Workers KV namespace of its own, through its binding, the batches the origin does not
take for now, until it does (channel.js, the report channel). No API request is made for records.
"""

from __future__ import annotations

import json

from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.cloudflare import CloudflareClient, NamedKv
from capabilities.runtimes.cloudflare.account import TAIL_WORKER
from capabilities.runtimes.sigil_worker import SigilWorker
from capabilities.workerd.config import HOST_DIR, HOST_MODULES

TAIL_KV_TITLE = "sigil-call-records"
_SOURCES = {name: (HOST_DIR / name).read_text() for name in ("tail.js", *HOST_MODULES)}


class TailMailbox:
    """The Tail Worker, where it pushes records (`origin`) and the KV namespace it spools them
    in; `skip` names Workers whose own events are no capability's (the dispatch Worker).
    Thread-safe."""

    def __init__(
        self,
        *,
        client: CloudflareClient,
        limits: dict,
        origin: RecordsOrigin,
        skip: tuple[str, ...] = (),
        invoke_base: str = "",
    ) -> None:
        self.client = client
        self.limits = limits
        self.origin = origin
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
                    *self.origin.bindings(),
                ],
                secret_bindings=self.origin.secret_bindings(),
                version_binding="SIGIL_TAIL_VERSION",
                invoke_base=self.invoke_base,
            )
        return self._worker

    def provision(self) -> list[str]:
        """Deploy the Tail Worker if it is missing or runs other code (its bindings included:
        a new origin redeploys it). Idempotent."""
        if self.worker.deploy():
            return [f"deployed the Tail Worker {TAIL_WORKER} ({self.worker.version})"]
        return []
