"""The loader runtime: Cloudflare's Dynamic Workers. One Sigil Worker (the loader host of the
local runtime, `host/host.js`) loads capability code at run time through its Worker Loader,
reading bundles from Workers KV (reference §5, §6)."""

from __future__ import annotations

import json
import time

import urllib3
from django.conf import LazySettings

from capabilities.log_limits import host_log_limits
from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.base import TEXT_BINDING_KINDS, CodeBundle, Route
from capabilities.runtimes.billing import Prices, RuntimeBill, Usage
from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareNotFound, NamedKv
from capabilities.runtimes.cloudflare.account import Finding, PlanProbe
from capabilities.runtimes.edge import Edge, EdgeSettings
from capabilities.runtimes.errors import RuntimeRejected
from capabilities.runtimes.loader_host import HostNotReached, loader_host_start_check, loader_host_store
from capabilities.runtimes.sigil_worker import FrontedRuntime, SigilWorker
from capabilities.workerd.config import HOST_DIR, HOST_MODULES

HOST_MODULE = HOST_MODULES[0]
HOST_SOURCES = {name: (HOST_DIR / name).read_text() for name in HOST_MODULES}
CODE_PREFIX = "code:"
SLOT_PREFIX = "slot:"
# The host's tail (host.js SigilTail) spools in the same namespace, under `spool:`, the batches
# of call records the origin does not take for now.


class LoaderRuntime(FrontedRuntime):
    """Unlimited slots: no pager, and no script per capability.

    Bundles are content-addressed in KV (`code:{sha}`); a placement is a pointer key
    `slot:{full name}` whose metadata holds the sha, so `list_slots` is one KV listing and
    `remove` frees a bundle no other slot points at. The loader id is `{full name}@{sha}`
    and nothing else: each distinct id is billed per day (reference §5.1), so ids change
    only with the code.

    Workers KV is eventually consistent: right after a placement another location may not
    see the bundle yet; the host then answers "missing-code", the engine places the
    capability again and retries once. A read that found nothing is cached where it was made
    (up to 60 s), so a placement whose start check finds no code has the host write the
    bundle through its own binding, which its own reads see at once, and checks again.
    """

    name = "loader"

    @classmethod
    def from_settings(cls) -> LoaderRuntime:
        from django.conf import settings

        return cls(
            **cls.account_settings(),
            worker=settings.SIGIL_LOADER_WORKER,
            kv_title=settings.SIGIL_LOADER_KV_TITLE,
            propagation_wait_seconds=settings.SIGIL_INVOKE_TIMEOUT_SECONDS,
            log_limits=host_log_limits(),
        )

    marker_header = "x-sigil-host"

    @classmethod
    def front_name(cls, settings: LazySettings) -> str:
        return settings.SIGIL_LOADER_WORKER

    @classmethod
    def plan_finding(cls, *, client: CloudflareClient, probe: PlanProbe, settings: LazySettings) -> Finding:
        """A Worker Loader binding needs Workers Paid: the probe of the plan has found out."""
        return probe.finding

    @classmethod
    def bills(cls, usage: Usage, prices: Prices, *, smallest_slots: int | None) -> list[RuntimeBill]:
        """Dynamic Workers, on Workers Paid: each call is two requests (the loader Worker and
        the Dynamic Worker it calls), and each capability called on a day is one Dynamic Worker
        that day; Workers KV's operations (the bundles, the call records)."""
        requests = 2 * usage.calls
        items = prices.plan_lines("paid", requests=requests, cpu_ms=usage.duration_ms)
        items["kv"] = prices.kv_line(usage)
        extra_workers = max(0.0, usage.dynamic_worker_days - prices.dynamic_included_workers)
        items["dynamic_workers"] = extra_workers * prices.dynamic_worker_day_usd
        plan = "Dynamic Workers (Workers Paid)"
        return [RuntimeBill.of(runtime=cls.name, plan=plan, items=items, requests=requests, cpu_ms=usage.duration_ms)]

    # A Dynamic Worker's env holds plain values (reference §5.3): variables and secrets.
    binding_kinds = TEXT_BINDING_KINDS

    def __init__(
        self,
        *,
        client: CloudflareClient,
        worker: str,
        kv_title: str,
        secret: str,
        cpu_ms: int,
        invoke_base: str = "",
        propagation_wait_seconds: float = 30.0,
        log_limits: dict | None = None,
        records_origin: RecordsOrigin | None = None,
        edge: EdgeSettings | None = None,
    ) -> None:
        super().__init__(cpu_ms=cpu_ms)
        # The edge rides in the loader Worker: callers' requests to it are served there.
        self.edge = Edge(client=client, settings=edge, backend=self.name, secret=secret) if edge else None
        #: the per-call bounds of the host's tail; None: the host gives capabilities no tail
        self.log_limits = log_limits if records_origin is not None else None
        #: where the host's tail pushes call records
        self.records_origin = records_origin
        self.propagation_wait_seconds = propagation_wait_seconds
        self.client = client
        self.kv = NamedKv(client=client, title=kv_title)
        self.worker_name = worker
        self.invoke_base = invoke_base
        self._secret = secret
        self._worker: SigilWorker | None = None
        self._start_checks = urllib3.PoolManager(timeout=urllib3.Timeout(connect=3.0, read=30.0), retries=False)

    # --- Sigil's loader Worker and its KV namespace --------------------------------------------

    @property
    def kv_id(self) -> str:
        """The id of the KV namespace of the code bundles, created if missing. No API request
        once any process has learnt it (AccountFacts): the loader Worker's route needs it."""
        return self.kv.id

    def _namespace_gone(self) -> None:
        """Cloudflare says the kept namespace id names no namespace: learn it again, and bind the
        loader Worker (deployed again by the next provision) to the one found or created."""
        self.kv.forget()
        self._worker = None
        self._provisioned = False

    @property
    def front(self) -> SigilWorker:
        return self.worker

    @property
    def worker(self) -> SigilWorker:
        """Sigil's loader Worker; built once the KV namespace is known (its binding names it)."""
        if self._worker is None:
            edge = self.edge
            self._worker = SigilWorker(
                client=self.client,
                name=self.worker_name,
                modules={**HOST_SOURCES, **(edge.modules() if edge else {})},
                main_module=HOST_MODULE,
                bindings=[
                    {"type": "worker_loader", "name": "LOADER"},
                    {"type": "kv_namespace", "name": "CODE_KV", "namespace_id": self.kv_id},
                    *self._log_bindings(),
                    *(edge.bindings() if edge else []),
                ],
                secret_bindings=[
                    {"type": "secret_text", "name": "SIGIL_SECRET", "text": self._secret},
                    *(self.records_origin.secret_bindings() if self.log_limits is not None and not edge else []),
                    *(edge.secret_bindings() if edge else []),
                ],
                version_binding="SIGIL_HOST_VERSION",
                # The host hands each capability its own SigilTail entrypoint (ctx.exports) as its tail.
                compatibility_flags=["enable_ctx_exports"],
                invoke_base=self.invoke_base,
                probe_header="x-sigil-secret",
            )
        return self._worker

    def _log_bindings(self) -> list[dict]:
        """Where each capability's tail pushes its call records, and the namespace it spools
        them in meanwhile (none when they are off: the host then gives capabilities no tail)."""
        if self.log_limits is None:
            return []
        spool = {"type": "kv_namespace", "name": "LOG_KV", "namespace_id": self.kv_id}
        if self.edge is not None:
            return [spool]  # the edge's bindings name the same endpoint and limits: its reports go that way too
        return [
            spool,
            {"type": "plain_text", "name": "LOG_LIMITS", "text": json.dumps(self.log_limits)},
            *self.records_origin.bindings(),
        ]

    def provision(self) -> list[str]:
        """Create the KV namespace if it is missing, and deploy the loader Worker if it is
        missing or runs other code. Idempotent."""
        done = []
        if self.kv.provision():
            done.append(f"created the KV namespace {self.kv.title} ({self.kv.id})")
        if self.worker.deploy():
            done.append(f"deployed the loader Worker {self.worker.name} ({self.worker.version})")
        self._provisioned = True
        return done

    # --- the Runtime interface -----------------------------------------------------------------

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        return full_name  # full names are unique, and KV keys hold up to 512 bytes

    def place(self, *, slot: str, bundle: CodeBundle, tenant: str) -> None:
        """Write the bundle under its sha, have the loader Worker start it, then point the
        slot at it: two KV writes, a KV read and one request to the loader Worker (after the
        first placement of the process; two more when the Worker did not see the bundle),
        and when other code is replaced, a listing and the delete that free its bundle.
        Idempotent. Raises RuntimeRejected when the code does not start."""
        self._ensure_provisioned()
        # Its secrets are sealed for the loader Worker, whose SIGIL_SECRET opens them.
        stored = bundle.to_json(seal_key=self._secret)
        try:
            self.client.kv_put(self.kv_id, CODE_PREFIX + bundle.sha, stored)
        except CloudflareNotFound:
            # A write never misses its key: the namespace itself is gone.
            self._namespace_gone()
            self._ensure_provisioned()
            self.client.kv_put(self.kv_id, CODE_PREFIX + bundle.sha, stored)
        route = self.route(slot=slot, sha=bundle.sha, tenant=tenant)
        try:
            if not self._start_check(route):
                # The host's location does not see the API's write yet, and will not while
                # its miss is cached: written through the host, it is seen there at once.
                # Other locations see the API's write once it propagates (KV's own delay).
                loader_host_store(self._start_checks, route, stored)
                self._start_check(route)
        except RuntimeRejected:
            # Code that does not start is placed nowhere, so no slot points at its sha.
            self.client.kv_delete(self.kv_id, CODE_PREFIX + bundle.sha)
            raise
        previous = self._pointed_sha(slot)
        self.client.kv_put(self.kv_id, SLOT_PREFIX + slot, bundle.sha.encode(), metadata={"sha": bundle.sha})
        if previous not in (None, bundle.sha):
            self._drop_if_unused(previous, self._pointers())  # the replaced code, old secrets and all

    def _start_check(self, route: Route) -> bool:
        """The loader host's start check. The loader Worker deployed by this placement is
        served only once Cloudflare has propagated it (its URL answers Cloudflare's own 404
        until then): ask again, backing off, for up to `propagation_wait_seconds`."""
        deadline = time.monotonic() + self.propagation_wait_seconds
        pause = 0.05
        while True:
            try:
                return loader_host_start_check(self._start_checks, route)
            except HostNotReached:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def remove(self, *, slot: str) -> None:
        """Drop the slot's pointer, and its bundle when no other slot points at it. Idempotent."""
        pointers = self._pointers()
        sha = pointers.pop(slot, None)
        if sha is None:
            return
        self.client.kv_delete(self.kv_id, SLOT_PREFIX + slot)
        self._drop_if_unused(sha, pointers)

    def _pointed_sha(self, slot: str) -> str | None:
        try:
            return self.client.kv_get(self.kv_id, SLOT_PREFIX + slot).decode()
        except CloudflareNotFound:
            return None

    def _drop_if_unused(self, sha: str, pointers: dict[str, str]) -> None:
        if sha not in pointers.values():
            self.client.kv_delete(self.kv_id, CODE_PREFIX + sha)

    def _pointers(self) -> dict[str, str]:
        """slot -> sha, from one listing of the pointer keys and their metadata."""
        return {
            key["name"][len(SLOT_PREFIX) :]: str((key.get("metadata") or {}).get("sha", ""))
            for key in self.client.kv_keys(self.kv_id, prefix=SLOT_PREFIX)
        }

    def route(self, *, slot: str, sha: str, tenant: str, cpu_ms: int | None = None) -> Route:
        return self._front_route([("X-Sigil-Secret", self._secret), ("X-Sigil-Loader-Id", f"{slot}@{sha}")], cpu_ms)

    def list_slots(self) -> list[str]:
        return sorted(self._pointers())

    def edge_url(self) -> str | None:
        return self.edge.url(self.worker) if self.edge is not None else None
