"""What every runtime on a Cloudflare account shares: the account's settings and its check
(CF_ACCOUNT_ID), the local emulator it runs against without a token, and the words of
`manage.py cfcheck` about the account's plan and script quota."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from abc import abstractmethod
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import LazySettings
from django.core.checks import CheckMessage, Error

from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.api_work import ApiClass, waits_within
from capabilities.runtimes.base import Process, Runtime
from capabilities.runtimes.cloudflare.budget import CEILINGS
from capabilities.runtimes.cloudflare.client import CloudflareClient
from capabilities.runtimes.cloudflare.kv import NamedKv

# Every pooled worker's script name starts so (worker_pool.pool_script_name): the account's
# other scripts are not Sigil's, but for its own Workers (sigil_script_names).
POOL_PREFIX = "s-"
# Sigil's Tail Worker (tail_worker.py), on the runtimes whose capabilities are scripts of
# their own, and the Worker cfcheck uploads and deletes to learn the plan (services/cfcheck.py).
TAIL_WORKER = "sigil-tail"
PLAN_PROBE_WORKER = "sigil-cfcheck-probe"
# Worker scripts an account may hold, by plan (reference §7.3); over it, uploads are 10037.
FREE_PLAN, PAID_PLAN = "Workers Free", "Workers Paid"
PLAN_SCRIPT_LIMITS = {FREE_PLAN: 100, PAID_PLAN: 500}


def installation_tag(secret: str) -> str:
    """The tag on every script this Sigil installation uploads to Cloudflare: unique to it
    (derived from its SIGIL_INTERNAL_SECRET, which it never shows), so reconcile and a switch
    touch only what this installation created, never the owner's own scripts, even ones
    tagged `sigil` or named like Sigil's."""
    digest = hmac.new(secret.encode(), b"sigil installation tag", hashlib.sha256).hexdigest()
    return f"sigil-{digest[:16]}"


def runs_on_local_emulator(settings: LazySettings) -> bool:
    """Whether CF_API_BASE points at the Cloudflare emulator on this machine (CF_EMULATOR_PORT),
    which must then run too: what settings give a Cloudflare runtime without CF_API_TOKEN."""
    api = urlsplit(settings.CF_API_BASE)
    return api.hostname in ("127.0.0.1", "localhost") and api.port == settings.CF_EMULATOR_PORT


@dataclass(frozen=True)
class Finding:
    """One thing `cfcheck` checked: `ok`, or what is missing in plain words. A missing thing
    that is not `blocking` is worth knowing but does not stop the runtime from working."""

    topic: str
    ok: bool
    detail: str
    blocking: bool = True


@dataclass(frozen=True)
class PlanProbe:
    """What cfcheck learnt of the account's plan (Workers Paid allows a Worker Loader binding,
    Workers Free refuses it; None when it could not tell), the script limit a 10037 named, and
    the plan finding for a runtime that needs Worker Loader bindings."""

    plan: str | None
    finding: Finding
    limit: int | None = None

    @property
    def script_limit(self) -> int | None:
        return self.limit or PLAN_SCRIPT_LIMITS.get(self.plan or "")


@dataclass(frozen=True)
class ScriptsInUse:
    """The account's scripts against its limit: `limit`, how many are not Sigil's, and a
    sentence saying so."""

    limit: int
    others: int
    used: str


def sigil_script_names(settings: LazySettings) -> frozenset[str]:
    """The names of every Worker script of Sigil's own on an account, whichever runtime serves
    now (a switch leaves the last one's until it is deleted), besides the pool's capability
    scripts (POOL_PREFIX): the platform runtime's dispatch Worker, the loader runtime's host,
    the worker-pool's edge Worker, the Tail Worker and cfcheck's plan probe."""
    return frozenset(
        {
            settings.SIGIL_PLATFORM_DISPATCHER,
            settings.SIGIL_LOADER_WORKER,
            settings.SIGIL_EDGE_WORKER,
            TAIL_WORKER,
            PLAN_PROBE_WORKER,
        }
    )


def is_sigils(script: str, settings: LazySettings) -> bool:
    """Whether the account's Worker script `script` is one of Sigil's own."""
    return script.startswith(POOL_PREFIX) or script in sigil_script_names(settings)


def scripts_in_use(scripts: list[str], probe: PlanProbe, *, settings: LazySettings) -> ScriptsInUse:
    """The account's `scripts` against its real limit (its plan's, the one a 10037 named, or
    SIGIL_POOL_TOTAL_QUOTA when neither is known), and how many are not Sigil's (is_sigils)."""
    limit = probe.script_limit
    if limit is None:  # the plan could not be told: take the owner's word
        limit, source = settings.SIGIL_POOL_TOTAL_QUOTA, "as SIGIL_POOL_TOTAL_QUOTA states it"
    else:
        source = f"the {probe.plan} plan's" if probe.plan and not probe.limit else "as Cloudflare's refusal named it"
    sigils = {name for name in scripts if is_sigils(name, settings)}
    others = len(scripts) - len(sigils)
    used = f"{len(scripts)} of the account's {limit} Worker scripts ({source}) are in use, {others} of them not Sigil's"
    return ScriptsInUse(limit=limit, others=others, used=used)


class CloudflareRuntime(Runtime):
    """A runtime on a Cloudflare account (CF_ACCOUNT_ID, CF_API_TOKEN): against the local
    emulator when settings point CF_API_BASE at it, which runsigil then runs."""

    on_cloudflare = True
    client: CloudflareClient

    @staticmethod
    def account_settings() -> dict:
        """What every runtime on the account is built with, from settings: the client, Sigil's
        secret (its Workers refuse calls without it), the default CPU limit per call, where
        the account's Workers are called, and where they push call records (None: nowhere,
        so capabilities are given no tail)."""
        from django.conf import settings

        from capabilities.runtimes.edge import EdgeSettings  # it builds on this module

        return {
            "client": CloudflareClient.from_settings(),
            "secret": settings.SIGIL_INTERNAL_SECRET,
            "cpu_ms": settings.SIGIL_CPU_MS,
            "invoke_base": settings.SIGIL_CF_WORKERS_BASE,
            "records_origin": RecordsOrigin.from_settings(),
            "edge": EdgeSettings.from_settings(),
        }

    @classmethod
    def settings_warnings(cls, settings: LazySettings) -> list[str]:
        """Call records are on but cannot arrive: no SIGIL_ORIGIN_URL says where Sigil's
        Workers on Cloudflare reach this server."""
        if not settings.SIGIL_LOGS_ENABLED or settings.SIGIL_ORIGIN_URL:
            return []
        return [
            "call records cannot arrive from Cloudflare: set SIGIL_ORIGIN_URL to the public URL where "
            "Sigil's Workers reach this server (https://sigil.example.com); until then capabilities get no tail"
        ]

    def api_waits_shared(self) -> contextlib.AbstractContextManager:
        return waits_within(self.client.budget.max_wait_seconds)

    @abstractmethod
    def passed_on(self, response) -> bool:
        """Whether Sigil's Worker passed `response` on, or made it: every answer of the
        capability's code passes one (which marks it), so an answer without that mark is
        Cloudflare's own."""

    def stopped_at_limits(self, response) -> bool:
        # Cloudflare's 1102, for the code Sigil's Worker was running, which never marked it.
        return response.status == 503 and not self.passed_on(response)

    def failed_itself(self, response) -> bool:
        # Any other 5xx of Cloudflare's own: its error page for its own side failing (a 500 of
        # category "cloudflare", a 502), which no code of the capability's answered.
        return response.status >= 500 and response.status != 503 and not self.passed_on(response)

    def kv_namespace(self, title: str) -> NamedKv:
        """The Workers KV namespace of Sigil's titled `title` on the account (the edge's
        state): its id is found or created once, for every process. No I/O until used."""
        return NamedKv(client=self.client, title=title)

    @classmethod
    def settings_errors(cls, settings: LazySettings) -> list[CheckMessage]:
        from capabilities.runtimes.edge import edge_settings_errors  # it builds on this module

        errors = []
        if not settings.CF_ACCOUNT_ID:
            errors.append(Error("CF_ACCOUNT_ID is required with CF_API_TOKEN", id="sigil.E003"))
        most = CEILINGS[ApiClass.HOUSEKEEPING]
        if not 0 < settings.SIGIL_CF_HOUSEKEEPING_SHARE <= most:
            errors.append(
                Error(
                    f"SIGIL_CF_HOUSEKEEPING_SHARE is {settings.SIGIL_CF_HOUSEKEEPING_SHARE}",
                    hint=f"Use a share over 0 and at most {most}: housekeeping never takes more of the window.",
                    id="sigil.E006",
                )
            )
        return errors + edge_settings_errors(settings)

    @classmethod
    def processes(cls, settings: LazySettings) -> list[Process]:
        if not runs_on_local_emulator(settings):
            return []
        emulator = Process(
            name="cfemulator",
            command="cfemulator",
            port=settings.CF_EMULATOR_PORT,
            port_name="the Cloudflare emulator's port",
            port_hint="set CF_EMULATOR_PORT and CF_API_BASE",
            description=f"Cloudflare emulator at {settings.CF_API_BASE}",
        )
        return [emulator]

    @classmethod
    def where(cls, settings: LazySettings) -> list[str]:
        return super().where(settings) or [f"Cloudflare API at {settings.CF_API_BASE}"]

    @classmethod
    @abstractmethod
    def account_findings(
        cls, *, client: CloudflareClient, probe: PlanProbe, scripts: list[str], settings: LazySettings
    ) -> list[Finding]:
        """What `cfcheck` says of the account for this runtime, once the token, the account and
        its subdomain are known to be good: whether its plan has what the runtime needs, and
        whether its script quota leaves the runtime room. Raises CloudflareUnavailable."""
