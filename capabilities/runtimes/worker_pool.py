"""The worker-pool runtime: each live capability is its own Worker script `s-{hash6}` on a
Cloudflare account, reached at its workers.dev URL; the pager keeps the account's script
quota (sigil-backend-lru.md)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from django.conf import LazySettings
from django.core.checks import CheckMessage, Error

from capabilities.log_limits import host_log_limits
from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.base import CodeBundle, Route
from capabilities.runtimes.billing import Prices, RuntimeBill, Usage
from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareNotFound, metadata_binding
from capabilities.runtimes.cloudflare.account import (
    POOL_PREFIX,
    CloudflareRuntime,
    Finding,
    PlanProbe,
    installation_tag,
    scripts_in_use,
)
from capabilities.runtimes.cloudflare.facts import SUBDOMAIN, AccountFacts
from capabilities.runtimes.cloudflare.uploads import (
    CAPABILITY_MODULE,
    MASK_MODULE,
    SECRET_MODULE,
    secret_names_binding,
    sigil_modules,
)
from capabilities.runtimes.edge import Edge, EdgeSettings
from capabilities.runtimes.sigil_worker import SigilWorker
from capabilities.runtimes.tail_worker import TailMailbox

GUARD_MODULE = "sigil-guard.js"
GUARD_SOURCE = (Path(__file__).resolve().parent / "pool" / "guard.js").read_text()
GUARD_SECRET_BINDING = "SIGIL_GUARD_SECRET"
# A plain_text binding read by the guard, which names the version in SERVED_VERSION_HEADER.
GUARD_VERSION_BINDING = "SIGIL_SERVED_VERSION"
POOL_TAG = "sigil"  # for people reading the account; what marks Sigil's own is installation_tag


def pool_script_name(full: str, *, length: int = 6) -> str:
    """The pooled worker's stable script name: `s-` + the first hex digits of sha256(full)."""
    return POOL_PREFIX + hashlib.sha256(full.encode()).hexdigest()[:length]


def pool_slots(*, total_quota: int, system_reserved: int, user_reserved: int, safety_margin: int) -> int:
    """The worker pool's slots: the account's script quota, less the scripts kept for Sigil's
    own Workers and for the owner's other Workers, less the margin for deletes under way."""
    return total_quota - system_reserved - user_reserved - safety_margin


def settings_slots(settings: LazySettings, *, total_quota: int | None = None, user_reserved: int | None = None) -> int:
    """The pool's slots as the SIGIL_POOL_* settings give them, or with the account's real
    `total_quota` and the owner's real `user_reserved` instead."""
    return pool_slots(
        total_quota=settings.SIGIL_POOL_TOTAL_QUOTA if total_quota is None else total_quota,
        system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
        user_reserved=settings.SIGIL_POOL_USER_RESERVED if user_reserved is None else user_reserved,
        safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
    )


class WorkerPoolRuntime(CloudflareRuntime):
    """Slots = total quota − system reserved − user reserved − safety margin.

    Only `s-` scripts are Sigil's: `list_slots` ignores the owner's own Workers, and Sigil
    never deletes or counts them; an `s-` script without this installation's tag
    (`created_here`) is the owner's too, and never deleted.
    """

    name = "worker-pool"
    places_in_background = True

    @classmethod
    def from_settings(cls) -> WorkerPoolRuntime:
        from django.conf import settings

        return cls(
            **cls.account_settings(),
            total_quota=settings.SIGIL_POOL_TOTAL_QUOTA,
            system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
            user_reserved=settings.SIGIL_POOL_USER_RESERVED,
            safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
            redirect=settings.SIGIL_POOL_REDIRECT,
            log_limits=host_log_limits(),
        )

    @classmethod
    def settings_errors(cls, settings: LazySettings) -> list[CheckMessage]:
        """The quota must leave slots once the reserved scripts and the margin are set aside."""
        errors = super().settings_errors(settings)
        slots = settings_slots(settings)
        if slots < 1:
            hint = "SIGIL_POOL_TOTAL_QUOTA must exceed SYSTEM_RESERVED + USER_RESERVED + SAFETY_MARGIN."
            errors.append(Error(f"the worker pool has {slots} slots", hint=hint, id="sigil.E002"))
        return errors

    @classmethod
    def bills(cls, usage: Usage, prices: Prices, *, smallest_slots: int | None) -> list[RuntimeBill]:
        """On Workers Free while the traffic fits its limits, and on Workers Paid: one Worker
        request per call (the engine runs outside Cloudflare), and Workers KV's operations (the
        collection of call records). The Tail Worker that hands the call records over runs once
        a call, billed by its CPU time alone (which Sigil cannot see), and only on Workers Paid."""
        limits = []
        if usage.busiest_day_calls > prices.free_requests_per_day:
            limits.append(
                f"the busiest day had {usage.busiest_day_calls} calls, over {prices.free_requests_per_day} a day"
            )
        if usage.calls_over_free_cpu_share > 0:
            limits.append(
                f"{usage.calls_over_free_cpu_share:.1%} of calls took over {prices.free_cpu_ms_per_call} ms "
                "(an upper bound of their CPU time)"
            )
        if smallest_slots is not None and smallest_slots > prices.free_scripts:
            limits.append(
                f"cold calls stay under 1 % only with {smallest_slots} slots, over {prices.free_scripts} scripts"
            )
        limits += prices.kv_over_free(usage)
        if usage.tail_worker:
            limits.append("call records come through a Tail Worker, which Workers Free does not offer")
        free = RuntimeBill(
            runtime=cls.name,
            plan="Workers Free",
            monthly_usd=0.0,
            requests=usage.calls,
            cpu_ms=usage.duration_ms,
            items={},
            fits=not limits,
            limits=limits,
        )
        paid = prices.plan_lines("paid", requests=usage.calls, cpu_ms=usage.duration_ms)
        paid["kv"] = prices.kv_line(usage)
        return [
            free,
            RuntimeBill.of(
                runtime=cls.name, plan="Workers Paid", items=paid, requests=usage.calls, cpu_ms=usage.duration_ms
            ),
        ]

    @classmethod
    def account_findings(
        cls, *, client: CloudflareClient, probe: PlanProbe, scripts: list[str], settings: LazySettings
    ) -> list[Finding]:
        """Workers alone suffice; the scripts say how many slots Sigil can really use: the
        account's limit, less the scripts that are not Sigil's (or the owner's reserve, if
        more), Sigil's own and the margin."""
        plan = Finding("plan", True, "the worker-pool runtime needs nothing beyond Workers")
        count = scripts_in_use(scripts, probe, settings=settings)
        configured = settings_slots(settings)
        usable = settings_slots(
            settings, total_quota=count.limit, user_reserved=max(count.others, settings.SIGIL_POOL_USER_RESERVED)
        )
        really = max(0, min(configured, usable))
        if really >= configured:
            return [plan, Finding("scripts", True, f"{count.used}; Sigil can use its {configured} slots")]
        detail = (
            f"{count.used}; Sigil can really use {really} slots, not the {configured} its settings give "
            f"(SIGIL_POOL_TOTAL_QUOTA {settings.SIGIL_POOL_TOTAL_QUOTA}, less SIGIL_POOL_SYSTEM_RESERVED, "
            "SIGIL_POOL_USER_RESERVED and SIGIL_POOL_SAFETY_MARGIN): lower SIGIL_POOL_TOTAL_QUOTA"
            f" to {count.limit}, or SIGIL_POOL_USER_RESERVED to at least {count.others}, or the pool pages out "
            "on Cloudflare's refusals (10037)"
        )
        # A pool with no slot at all cannot work; one with fewer works, paging out more.
        return [plan, Finding("scripts", False, detail, blocking=really < 1)]

    def __init__(
        self,
        *,
        client: CloudflareClient,
        secret: str,
        total_quota: int,
        system_reserved: int,
        user_reserved: int,
        safety_margin: int,
        invoke_base: str = "",
        redirect: bool = False,
        cpu_ms: int = 0,
        log_limits: dict | None = None,
        records_origin: RecordsOrigin | None = None,
        edge: EdgeSettings | None = None,
    ) -> None:
        self.client = client
        # Sigil's Tail Worker, named in every script's tail_consumers (one of the account's
        # scripts: SIGIL_POOL_SYSTEM_RESERVED counts it); None when call records are off or
        # have nowhere to go.
        self.tails = (
            TailMailbox(client=client, limits=log_limits, origin=records_origin, invoke_base=invoke_base)
            if log_limits and records_origin
            else None
        )
        # The edge: a Worker of its own (`sigil-edge`, another of Sigil's scripts), reaching
        # pooled scripts by their workers.dev URLs with the guard's secret. None while off.
        self.edge = Edge(client=client, settings=edge, backend=self.name, secret=secret) if edge else None
        self._edge_worker: SigilWorker | None = None
        self._provisioned = False
        self.default_cpu_ms = cpu_ms
        self.redirects = redirect
        self._secret = secret
        self.installation_tag = installation_tag(secret)
        self.slots = pool_slots(
            total_quota=total_quota,
            system_reserved=system_reserved,
            user_reserved=user_reserved,
            safety_margin=safety_margin,
        )
        self.margin = safety_margin
        # Empty: call https://{script}.{subdomain}.workers.dev. Set (the emulator): call this
        # base URL with the workers.dev name in the Host header.
        self.invoke_base = invoke_base.rstrip("/")
        self.facts = AccountFacts(client)
        # Set when a call met Cloudflare's own 404 (no script there, or a workers.dev subdomain
        # that is no longer the account's): the page-in that follows asks for the subdomain again.
        self._subdomain_doubted = False

    @property
    def total_slots(self) -> int:
        return self.slots

    @property
    def safety_margin(self) -> int:
        return self.margin

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        # s-{6 hex}; on a collision two more hex digits per attempt.
        return pool_script_name(full_name, length=6 + 2 * attempt)

    def place(self, *, slot: str, bundle: CodeBundle, tenant: str) -> None:
        """Upload the script behind Sigil's guard and turn its workers.dev URL on. The guard
        names `bundle.version` (when given) in every answer's SERVED_VERSION_HEADER.

        Two API calls, the fewest Cloudflare allows: the upload, and the per-script
        workers.dev toggle (reference §3.2: an API upload is not known to be reachable
        without it). The capability's CPU limit (its own, else the runtime's default; none
        when both are 0) goes with the upload as `limits.cpu_ms` (reference §1.2), which
        Cloudflare enforces on every call: a script's limit changes when it is next placed.
        Idempotent.
        """
        bindings = [metadata_binding(b) for b in bundle.bindings]
        if self.redirects:
            # Callers are sent to the script itself, so it must answer them without Sigil.
            modules, main_module = bundle.modules, bundle.main_module
        else:
            guard = {GUARD_MODULE: GUARD_SOURCE, **sigil_modules(CAPABILITY_MODULE, SECRET_MODULE, MASK_MODULE)}
            modules, main_module = {**guard, **bundle.modules}, GUARD_MODULE
            bindings.append({"type": "secret_text", "name": GUARD_SECRET_BINDING, "text": self._secret})
            if bundle.secrets:
                bindings.append(secret_names_binding(bundle.secrets))
            if bundle.version is not None:
                # The upload replaces the script in place: its every answer says which version it is.
                bindings.append({"type": "plain_text", "name": GUARD_VERSION_BINDING, "text": str(bundle.version)})
        if self._subdomain_doubted:
            self._subdomain_doubted = False
            self.facts.forget(SUBDOMAIN)
            # The edge's Worker names the subdomain in its bindings: built and deployed again.
            self._edge_worker = None
            self._provisioned = False
        if (self.tails is not None or self.edge is not None) and not self._provisioned:
            self.provision()
        self.client.script_upload(
            slot,
            modules=modules,
            main_module=main_module,
            compatibility_date=bundle.compatibility_date,
            bindings=bindings,
            tags=[POOL_TAG, self.installation_tag, f"sha-{bundle.sha[:16]}"],
            limits={"cpu_ms": cpu_ms} if (cpu_ms := bundle.cpu_ms or self.default_cpu_ms) else None,
            tail_consumers=self.tails.consumers if self.tails is not None else (),
        )
        self.client.script_subdomain_set(slot, enabled=True)

    def remove(self, *, slot: str) -> None:
        with contextlib.suppress(CloudflareNotFound):
            self.client.script_delete(slot)

    def route(self, *, slot: str, sha: str, tenant: str, cpu_ms: int | None = None) -> Route:
        """Where the script answers. No API request once any process has learnt the account's
        subdomain (AccountFacts)."""
        host = f"{slot}.{self.subdomain}.workers.dev"
        headers = (("X-Sigil-Pool-Secret", self._secret),)
        if self.redirects:
            return Route(base_url=f"https://{host}", redirect=True)
        if self.invoke_base:
            return Route(base_url=self.invoke_base, headers=headers, host_header=host)
        return Route(base_url=f"https://{host}", headers=headers)

    @property
    def subdomain(self) -> str:
        return self.facts.subdomain()

    def passed_on(self, response) -> bool:
        # Every answer of a live script passes the guard, which marks it (its own refusals too);
        # the guard stopped with the capability (1102) marks nothing.
        return "x-sigil-guard" in response.headers

    def is_missing(self, response) -> bool:
        # Cloudflare's own "no such Worker" passed no guard; it may also mean the account's
        # subdomain changed, so the next route asks for it again (AccountFacts).
        missing = response.status == 404 and not self.passed_on(response)
        if missing:
            self._subdomain_doubted = True
        return missing

    def list_slots(self) -> list[str]:
        return sorted(s.id for s in self.client.script_list() if s.id.startswith(POOL_PREFIX))

    def created_here(self, *, slot: str) -> bool:
        """One API call (the script's settings): asked only of slots no capability holds."""
        try:
            tags = self.client.script_settings_get(slot).get("tags") or []
        except CloudflareNotFound:
            return False  # gone already: nothing to delete
        return self.installation_tag in tags

    def check(self) -> None:
        """No API request per probe: the account's subdomain as kept (asked once if no process
        knows it yet), and the edge's Worker probed over HTTP. Raises RuntimeUnavailable when
        the subdomain cannot be learnt or the edge's Worker does not answer as it should."""
        self.facts.subdomain()
        if self.edge is not None:
            self.edge_worker.probe()

    @property
    def edge_worker(self) -> SigilWorker:
        """The edge's Worker; built once the account's subdomain and the edge's KV namespace are
        known (its bindings name them), so a subdomain changed since is deployed again."""
        if self._edge_worker is None:
            self._edge_worker = self.edge.pool_worker(
                guard_secret=self._secret, subdomain=self.subdomain, invoke_base=self.invoke_base
            )
        return self._edge_worker

    def edge_url(self) -> str | None:
        return self.edge.url(self.edge_worker) if self.edge is not None else None

    def provision(self) -> list[str]:
        """Deploy Sigil's Tail Worker and the edge's Worker (with its KV namespace) if they are
        missing or stale (the first placement of each process does it too). Idempotent."""
        done = []
        if self.tails is not None:
            done += self.tails.provision()
        if self.edge is not None and self.edge_worker.deploy():
            done.append(f"deployed the edge Worker {self.edge_worker.name} ({self.edge_worker.version})")
        self._provisioned = True
        return done
