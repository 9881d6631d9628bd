"""The worker-pool runtime: each live capability is its own Worker script `s-{hash6}` on a
Cloudflare account, reached at its workers.dev URL; the pager keeps the account's script
quota (sigil-backend-lru.md)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from capabilities import names
from capabilities.call_logs import LogLimits
from capabilities.cloudflare import CloudflareClient, CloudflareNotFound
from capabilities.runtimes.base import CodeBundle, ResolvedBinding, Route, Runtime
from capabilities.runtimes.tail_worker import TailMailbox

GUARD_MODULE = "sigil-guard.js"
GUARD_SOURCE = (Path(__file__).resolve().parent / "pool" / "guard.js").read_text()
GUARD_SECRET_BINDING = "SIGIL_GUARD_SECRET"
# A plain_text binding read by the guard, which names the version in SERVED_VERSION_HEADER.
GUARD_VERSION_BINDING = "SIGIL_SERVED_VERSION"
POOL_PREFIX = "s-"
POOL_TAG = "sigil"  # for people reading the account; what marks Sigil's own is installation_tag


def metadata_binding(binding: ResolvedBinding) -> dict:
    """A declared binding as Cloudflare's upload metadata spells it (reference §1.3)."""
    shapes = {
        "VAR": {"type": "plain_text", "text": binding.value},
        "SECRET": {"type": "secret_text", "text": binding.value},
        "KV": {"type": "kv_namespace", "namespace_id": binding.value},
        "D1": {"type": "d1", "id": binding.value},
        "R2": {"type": "r2_bucket", "bucket_name": binding.value},
        "SERVICE": {"type": "service", "service": binding.value, "environment": "production"},
        "QUEUE": {"type": "queue", "queue_name": binding.value},
    }
    return {"name": binding.name, **shapes[binding.kind]}


def pool_slots(*, total_quota: int, system_reserved: int, user_reserved: int, safety_margin: int) -> int:
    """The worker pool's slots: the account's script quota, less the scripts kept for Sigil's
    own Workers and for the owner's other Workers, less the margin for deletes under way."""
    return total_quota - system_reserved - user_reserved - safety_margin


class WorkerPoolRuntime(Runtime):
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
            client=CloudflareClient.from_settings(),
            secret=settings.SIGIL_INTERNAL_SECRET,
            total_quota=settings.SIGIL_POOL_TOTAL_QUOTA,
            system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
            user_reserved=settings.SIGIL_POOL_USER_RESERVED,
            safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
            invoke_base=settings.SIGIL_CF_WORKERS_BASE,
            redirect=settings.SIGIL_POOL_REDIRECT,
            cpu_ms=settings.SIGIL_CPU_MS,
            log_limits=LogLimits.from_settings().for_host() if settings.SIGIL_LOGS_ENABLED else None,
        )

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
    ) -> None:
        self.client = client
        # Sigil's Tail Worker, named in every script's tail_consumers (one of the account's
        # scripts: SIGIL_POOL_SYSTEM_RESERVED counts it); None when call records are off.
        self.tails = TailMailbox(client=client, limits=log_limits, invoke_base=invoke_base) if log_limits else None
        self._tails_deployed = False
        self.default_cpu_ms = cpu_ms
        self.redirects = redirect
        self._secret = secret
        self.installation_tag = names.installation_tag(secret)
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
        self._subdomain: str | None = None

    @property
    def total_slots(self) -> int:
        return self.slots

    @property
    def safety_margin(self) -> int:
        return self.margin

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        # s-{6 hex}; on a collision two more hex digits per attempt.
        return names.pool_script_name(full_name, length=6 + 2 * attempt)

    def place(self, *, slot: str, bundle: CodeBundle) -> None:
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
            modules, main_module = {GUARD_MODULE: GUARD_SOURCE, **bundle.modules}, GUARD_MODULE
            bindings.append({"type": "secret_text", "name": GUARD_SECRET_BINDING, "text": self._secret})
            if bundle.version is not None:
                # The upload replaces the script in place: its every answer says which version it is.
                bindings.append({"type": "plain_text", "name": GUARD_VERSION_BINDING, "text": str(bundle.version)})
        if self.tails is not None and not self._tails_deployed:
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

    def route(self, *, slot: str, sha: str, cpu_ms: int | None = None) -> Route:
        """Where the script answers. The account's subdomain is asked for once per process."""
        host = f"{slot}.{self.subdomain}.workers.dev"
        headers = (("X-Sigil-Pool-Secret", self._secret),)
        if self.redirects:
            return Route(base_url=f"https://{host}", redirect=True)
        if self.invoke_base:
            return Route(base_url=self.invoke_base, headers=headers, host_header=host)
        return Route(base_url=f"https://{host}", headers=headers)

    @property
    def subdomain(self) -> str:
        if self._subdomain is None:
            self._subdomain = self.client.subdomain_get()
        return self._subdomain

    def is_missing(self, response) -> bool:
        # Every answer of a live script passes the guard, which marks it; Cloudflare's own
        # "no such Worker" does not.
        return response.status == 404 and "x-sigil-guard" not in response.headers

    def stopped_at_limits(self, response) -> bool:
        # Cloudflare's 1102 for a Worker past its CPU or memory limit is a 503 the guard,
        # stopped with the capability, never marked.
        return response.status == 503 and "x-sigil-guard" not in response.headers

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
        self._subdomain = self.client.subdomain_get()

    def provision(self) -> list[str]:
        """Deploy Sigil's Tail Worker if it is missing or stale (the first placement of each
        process does it too). Idempotent."""
        if self.tails is None:
            return []
        done = self.tails.provision()
        self._tails_deployed = True
        return done

    def call_records_take(self, *, limit: int) -> list[dict]:
        return self.tails.take(limit=limit) if self.tails is not None else []
