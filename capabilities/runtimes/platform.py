"""The platform runtime: Workers for Platforms. Every capability is a user Worker in one
dispatch namespace, named by its full name and always resident; Sigil's dispatch Worker
(`platform/dispatcher.js`) is the one entry point (sigil-registry.md, reference §4)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from django.conf import LazySettings

from capabilities.log_limits import host_log_limits
from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.base import CodeBundle, Route
from capabilities.runtimes.billing import Prices, RuntimeBill, Usage
from capabilities.runtimes.cloudflare import (
    CloudflareClient,
    CloudflareError,
    CloudflareNotFound,
    CloudflareRejected,
    metadata_binding,
)
from capabilities.runtimes.cloudflare.account import Finding, PlanProbe, installation_tag
from capabilities.runtimes.cloudflare.uploads import (
    CAPABILITY_MODULE,
    MASK_MODULE,
    SECRET_MODULE,
    secret_names_binding,
    sigil_modules,
)
from capabilities.runtimes.edge import Edge, EdgeSettings
from capabilities.runtimes.sigil_worker import FrontedRuntime, SigilWorker
from capabilities.runtimes.tail_worker import TailMailbox

DISPATCHER_MODULE = "dispatcher.js"
DISPATCHER_SOURCE = (Path(__file__).resolve().parent / "platform" / DISPATCHER_MODULE).read_text()
# Tag of every capability script Sigil puts in the namespace: `list_slots` lists these. Only
# those with this installation's tag as well (account.installation_tag) are `created_here`.
CAPABILITY_TAG = "sigil"
# The entry module in front of a capability's own when its version is known (see the module).
VERSION_MODULE = "sigil-served-version.js"
VERSION_SOURCE = (Path(__file__).resolve().parent / "platform" / "served-version.js").read_text()
VERSION_BINDING = "SIGIL_SERVED_VERSION"
# A script name is one DNS label (reference §1.5); full names may be longer (74 characters).
MAX_SCRIPT_NAME = 63


class PlatformRuntime(FrontedRuntime):
    """Unlimited slots: no pager. A slot is the capability's full name (shortened with a hash
    when it is over 63 characters); `route` names it to the dispatch Worker, with the
    capability's CPU limit per call.

    `place` makes sure the namespace and the dispatch Worker exist the first time it runs in
    a process (`provision`), so a fresh account (or a fresh emulator) serves without a
    separate step; `check` probes the dispatch Worker without an API call.
    """

    name = "platform"

    @classmethod
    def from_settings(cls) -> PlatformRuntime:
        from django.conf import settings

        return cls(
            **cls.account_settings(),
            namespace=settings.SIGIL_PLATFORM_NAMESPACE,
            dispatcher=settings.SIGIL_PLATFORM_DISPATCHER,
            log_limits=host_log_limits(),
        )

    marker_header = "x-sigil-dispatch"

    @classmethod
    def front_name(cls, settings: LazySettings) -> str:
        return settings.SIGIL_PLATFORM_DISPATCHER

    @classmethod
    def plan_finding(cls, *, client: CloudflareClient, probe: PlanProbe, settings: LazySettings) -> Finding:
        """Workers for Platforms is on when the account lists its dispatch namespaces. One API call."""
        try:
            namespaces = client.namespace_list()
        except CloudflareRejected as exc:
            return Finding(
                "plan",
                False,
                f"Workers for Platforms is not enabled on the account, and the platform runtime needs its "
                f"subscription (Workers for Platforms Paid) ({exc})",
            )
        listed = {str(namespace.get("namespace_name") or namespace.get("name") or "") for namespace in namespaces}
        mine = settings.SIGIL_PLATFORM_NAMESPACE
        where = "exists" if mine in listed else "is created when Sigil starts"
        return Finding("plan", True, f"Workers for Platforms is enabled; the dispatch namespace {mine} {where}")

    @classmethod
    def bills(cls, usage: Usage, prices: Prices, *, smallest_slots: int | None) -> list[RuntimeBill]:
        """Workers for Platforms: the dispatch Worker and the capability's are billed as one
        request; one script per registered capability; Workers KV's operations (the collection of
        call records, whose Tail Worker is billed by its CPU time alone)."""
        items = prices.plan_lines("platforms", requests=usage.calls, cpu_ms=usage.duration_ms)
        items["kv"] = prices.kv_line(usage)
        items["scripts"] = max(0, usage.capabilities - prices.platforms_included_scripts) * prices.platforms_script_usd
        plan = "Workers for Platforms"
        return [
            RuntimeBill.of(runtime=cls.name, plan=plan, items=items, requests=usage.calls, cpu_ms=usage.duration_ms)
        ]

    def __init__(
        self,
        *,
        client: CloudflareClient,
        namespace: str,
        dispatcher: str,
        secret: str,
        cpu_ms: int,
        invoke_base: str = "",
        log_limits: dict | None = None,
        records_origin: RecordsOrigin | None = None,
        edge: EdgeSettings | None = None,
    ) -> None:
        super().__init__(cpu_ms=cpu_ms)
        # Sigil's Tail Worker, the dispatch Worker's tail consumer: it receives the user
        # Workers' events too, and skips the dispatch Worker's own. None: call records are
        # off, or have nowhere to go.
        self.tails = (
            TailMailbox(
                client=client, limits=log_limits, origin=records_origin, skip=(dispatcher,), invoke_base=invoke_base
            )
            if log_limits and records_origin
            else None
        )
        self.client = client
        self.namespace = namespace
        self._secret = secret
        self.installation_tag = installation_tag(secret)
        self.dispatcher_name = dispatcher
        self.invoke_base = invoke_base
        # The edge rides in the dispatch Worker: callers' requests to it are served there.
        self.edge = Edge(client=client, settings=edge, backend=self.name, secret=secret) if edge else None
        self._dispatcher: SigilWorker | None = None

    @property
    def dispatcher(self) -> SigilWorker:
        """Sigil's dispatch Worker; built once the edge's KV namespace is known (its binding names it)."""
        if self._dispatcher is None:
            edge = self.edge
            self._dispatcher = SigilWorker(
                client=self.client,
                name=self.dispatcher_name,
                modules={
                    DISPATCHER_MODULE: DISPATCHER_SOURCE,
                    **sigil_modules(SECRET_MODULE),
                    **(edge.modules() if edge else {}),
                },
                main_module=DISPATCHER_MODULE,
                bindings=[
                    {"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": self.namespace},
                    *(edge.bindings() if edge else []),
                ],
                secret_bindings=[
                    {"type": "secret_text", "name": "SIGIL_DISPATCH_SECRET", "text": self._secret},
                    *(edge.secret_bindings() if edge else []),
                ],
                version_binding="SIGIL_DISPATCHER_VERSION",
                tail_consumers=self.tails.consumers if self.tails is not None else (),
                invoke_base=self.invoke_base,
                probe_header="x-sigil-dispatch-secret",
            )
        return self._dispatcher

    @property
    def front(self) -> SigilWorker:
        return self.dispatcher

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        if attempt == 0 and len(full_name) <= MAX_SCRIPT_NAME:
            return full_name
        digest = hashlib.sha256(full_name.encode()).hexdigest()[: 8 + 2 * attempt]
        return f"{full_name[: MAX_SCRIPT_NAME - len(digest) - 1].rstrip('-')}-{digest}"

    def provision(self) -> list[str]:
        """Create the namespace if it is missing, and deploy the dispatch Worker if it is
        missing or runs other code. Idempotent."""
        done = []
        try:
            self.client.namespace_get(self.namespace)
        except CloudflareNotFound:
            try:
                self.client.namespace_create(self.namespace)
                done.append(f"created the dispatch namespace {self.namespace}")
            except CloudflareError:
                # Created by a concurrent provision meanwhile? Then this finds it; else it raises.
                self.client.namespace_get(self.namespace)
        if self.tails is not None:
            done += self.tails.provision()
        if self.dispatcher.deploy():
            done.append(f"deployed the dispatch Worker {self.dispatcher.name} ({self.dispatcher.version})")
        self._provisioned = True
        return done

    def place(self, *, slot: str, bundle: CodeBundle, tenant: str) -> None:
        """Upload the capability into the namespace, tagged with Sigil and its agent (`tenant`); with
        `bundle.version` or secrets, behind an entry module that names the version in every
        answer (SERVED_VERSION_HEADER), since the upload replaces the script in place, and masks
        the secrets in the capability's console and in what it throws (sigil-mask.js). One API
        call (after the first placement of the process). Idempotent."""
        self._ensure_provisioned()
        modules, main_module = bundle.modules, bundle.main_module
        bindings = [metadata_binding(b) for b in bundle.bindings]
        if (bundle.version is not None or bundle.secrets) and bundle.main_module == "main.js":
            entry = {VERSION_MODULE: VERSION_SOURCE, **sigil_modules(CAPABILITY_MODULE, MASK_MODULE)}
            modules, main_module = {**entry, **bundle.modules}, VERSION_MODULE
            if bundle.version is not None:
                bindings.append({"type": "plain_text", "name": VERSION_BINDING, "text": str(bundle.version)})
            if bundle.secrets:
                bindings.append(secret_names_binding(bundle.secrets))
        self.client.namespace_script_upload(
            self.namespace,
            slot,
            modules=modules,
            main_module=main_module,
            compatibility_date=bundle.compatibility_date,
            bindings=bindings,
            tags=[CAPABILITY_TAG, self.installation_tag, f"agent-{tenant}", f"sha-{bundle.sha[:16]}"],
        )

    def remove(self, *, slot: str) -> None:
        with contextlib.suppress(CloudflareNotFound):
            self.client.namespace_script_delete(self.namespace, slot)

    def route(self, *, slot: str, sha: str, tenant: str, cpu_ms: int | None = None) -> Route:
        return self._front_route([("X-Sigil-Dispatch-Secret", self._secret), ("X-Sigil-Script", slot)], cpu_ms)

    def edge_url(self) -> str | None:
        return self.edge.url(self.dispatcher) if self.edge is not None else None

    def list_slots(self) -> list[str]:
        return sorted(s.id for s in self.client.namespace_script_list(self.namespace, tags=[f"{CAPABILITY_TAG}:yes"]))

    def created_here(self, *, slot: str) -> bool:
        """One API call (the namespace's scripts with this installation's tag): asked only of
        slots no capability holds. A script tagged `sigil` alone is the owner's, or was
        uploaded before the installation's tag existed: never deleted."""
        mine = self.client.namespace_script_list(self.namespace, tags=[f"{self.installation_tag}:yes"])
        return slot in {s.id for s in mine}
