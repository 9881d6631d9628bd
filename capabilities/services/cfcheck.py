"""Whether a Cloudflare account can run a Cloudflare runtime, checked before an owner switches
to it: the API token, the account, its workers.dev subdomain, the plan's features the runtime
needs and the script quota, each reported in plain words (`manage.py cfcheck`)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from django.conf import settings

from capabilities.runtimes.cloudflare import (
    CloudflareAuthFailure,
    CloudflareClient,
    CloudflareError,
    CloudflareNotFound,
    CloudflareRejected,
    CloudflareSlotsExhausted,
    CloudflareUnavailable,
)
from capabilities.runtimes import RUNTIMES
from capabilities.runtimes.worker_pool import POOL_PREFIX, pool_slots

# The runtimes that run on a Cloudflare account.
CLOUDFLARE_BACKENDS = tuple(name for name in RUNTIMES if name != "local")
# A throwaway Worker that asks the account whether its plan allows a worker_loader binding:
# no read-only endpoint says so, and Cloudflare refuses such an upload on the free plan
# (reference §5.1: 10021 "binding LOADER of type worker_loader is invalid", or 10195).
LOADER_PROBE_SCRIPT = "sigil-cfcheck-probe"
LOADER_PROBE_MODULE = "probe.js"
LOADER_PROBE_SOURCE = 'export default { fetch() { return new Response("") } }\n'
# Cloudflare's codes for a binding or feature the plan does not include (reference §7.1).
PLAN_REFUSAL_CODES = frozenset({10021, 10075, 10195})
# Worker scripts an account may hold, by plan (reference §7.3); over it, uploads are 10037.
FREE_PLAN, PAID_PLAN = "Workers Free", "Workers Paid"
PLAN_SCRIPT_LIMITS = {FREE_PLAN: 100, PAID_PLAN: 500}
# Cloudflare's 10037 names the limit: "You have exceeded the limit of 500 Workers on your account."
_LIMIT_IN_REFUSAL = re.compile(r"limit of (\d+) Workers")


@dataclass(frozen=True)
class Finding:
    """One thing checked: `ok`, or what is missing in plain words. A missing thing that is not
    `blocking` is worth knowing but does not stop the runtime from working."""

    topic: str
    ok: bool
    detail: str
    blocking: bool = True


@dataclass(frozen=True)
class PlanProbe:
    """What the probe Worker learnt of the account: its plan (Workers Paid allows a Worker
    Loader binding, Workers Free refuses it; None when it could not tell), the script limit a
    10037 named, and the plan finding for the loader runtime."""

    plan: str | None
    finding: Finding
    limit: int | None = None

    @property
    def script_limit(self) -> int | None:
        return self.limit or PLAN_SCRIPT_LIMITS.get(self.plan or "")


@dataclass(frozen=True)
class CloudflareCheck:
    backend: str
    findings: tuple[Finding, ...]

    @property
    def ready(self) -> bool:
        """Whether the runtime can work on this account."""
        return all(finding.ok or not finding.blocking for finding in self.findings)


def cloudflare_check(*, backend: str, client: CloudflareClient | None = None) -> CloudflareCheck:
    """Check what `backend` (a Cloudflare runtime) needs of the account CF_ACCOUNT_ID, with
    CF_API_TOKEN (or `client`). Stops at the first failure that hides the rest (a token
    Cloudflare does not know, an account the token cannot use).

    Reads only, except on the loader runtime before its Worker exists: then it uploads and
    deletes the small Worker LOADER_PROBE_SCRIPT to learn whether the plan allows Worker
    Loader bindings. Raises ValueError for a backend that is not a Cloudflare runtime,
    ImproperlyConfigured without credentials.
    """
    if backend not in CLOUDFLARE_BACKENDS:
        raise ValueError(f"{backend!r} is not a Cloudflare runtime; choose one of {', '.join(CLOUDFLARE_BACKENDS)}")
    client = client or CloudflareClient.from_settings()
    findings: list[Finding] = []

    def done() -> CloudflareCheck:
        return CloudflareCheck(backend=backend, findings=tuple(findings))

    try:
        findings.append(_token(client))
        if not findings[-1].ok:
            return done()
        account, scripts = _account(client)
        findings.append(account)
        if not account.ok:
            return done()
        findings.append(_subdomain(client))
        probe = _plan_probe(client)
        findings.append(_plan(client, backend, probe))
        findings.append(_quota(backend, scripts, probe))
    except CloudflareUnavailable as exc:
        findings.append(Finding("Cloudflare", False, f"the API did not answer, so nothing more is known: {exc}"))
    return done()


def _token(client: CloudflareClient) -> Finding:
    try:
        token = client.token_verify()
    except CloudflareAuthFailure as exc:
        detail = f"Cloudflare does not accept this token: check CF_API_TOKEN (or CF_API_TOKEN_FILE) ({exc})"
        return Finding("API token", False, detail)
    status = str((token or {}).get("status", ""))
    if status != "active":
        return Finding("API token", False, f"the token is {status or 'not active'}: create a new one")
    return Finding("API token", True, "valid and active")


def _account(client: CloudflareClient) -> tuple[Finding, list[str]]:
    try:
        scripts = [script.id for script in client.script_list()]
    except CloudflareRejected as exc:
        detail = (
            f"the token cannot use the Workers of account {client.account_id}: check CF_ACCOUNT_ID, and that "
            f"the token has the permission Workers Scripts: Edit on that account ({exc})"
        )
        return Finding("account", False, detail), []
    return Finding("account", True, f"{client.account_id}: the token can use its Workers"), scripts


def _subdomain(client: CloudflareClient) -> Finding:
    try:
        subdomain = client.subdomain_get()
    except CloudflareNotFound:
        subdomain = ""
    if not subdomain:
        return Finding(
            "workers.dev subdomain",
            False,
            "the account has none, and Sigil's Workers are reached there: choose one in the dashboard "
            "(Workers & Pages)",
        )
    return Finding("workers.dev subdomain", True, f"{subdomain}.workers.dev")


def _plan(client: CloudflareClient, backend: str, probe: PlanProbe) -> Finding:
    if backend == "platform":
        try:
            namespaces = client.namespace_list()
        except CloudflareRejected as exc:
            return Finding(
                "plan",
                False,
                f"Workers for Platforms is not enabled on the account, and the platform runtime needs its "
                f"subscription (Workers for Platforms Paid) ({exc})",
            )
        names = {str(namespace.get("namespace_name") or namespace.get("name") or "") for namespace in namespaces}
        mine = settings.SIGIL_PLATFORM_NAMESPACE
        where = "exists" if mine in names else "is created when Sigil starts"
        return Finding("plan", True, f"Workers for Platforms is enabled; the dispatch namespace {mine} {where}")
    if backend == "loader":
        return probe.finding
    return Finding("plan", True, "the worker-pool runtime needs nothing beyond Workers")


def _plan_probe(client: CloudflareClient) -> PlanProbe:
    """Which plan the account is on, which no read-only endpoint says: Sigil's loader Worker
    already runs with a Worker Loader binding, or the probe Worker is uploaded with one."""
    allowed = "the plan allows Worker Loader bindings (Workers Paid)"
    with contextlib.suppress(CloudflareNotFound):
        deployed = client.script_settings_get(settings.SIGIL_LOADER_WORKER)
        if any(binding.get("type") == "worker_loader" for binding in deployed.get("bindings") or []):
            return PlanProbe(PAID_PLAN, Finding("plan", True, f"{allowed}: the loader Worker runs with one"))
    try:
        client.script_upload(
            LOADER_PROBE_SCRIPT,
            modules={LOADER_PROBE_MODULE: LOADER_PROBE_SOURCE},
            main_module=LOADER_PROBE_MODULE,
            compatibility_date="2025-01-01",
            bindings=[{"type": "worker_loader", "name": "LOADER"}],
        )
    except CloudflareSlotsExhausted as exc:
        found = _LIMIT_IN_REFUSAL.search(str(exc))
        detail = f"no room for a Worker to check the plan with: the script quota is full ({exc})"
        return PlanProbe(None, Finding("plan", False, detail), limit=int(found.group(1)) if found else None)
    except CloudflareRejected as exc:
        if exc.code in PLAN_REFUSAL_CODES:
            detail = f"the loader runtime's Worker Loader needs the Workers Paid plan: upgrade ({exc})"
            return PlanProbe(FREE_PLAN, Finding("plan", False, detail))
        detail = f"Cloudflare refused a Worker with a Worker Loader binding ({exc})"
        return PlanProbe(None, Finding("plan", False, detail))
    with contextlib.suppress(CloudflareError):
        client.script_delete(LOADER_PROBE_SCRIPT)
    return PlanProbe(PAID_PLAN, Finding("plan", True, allowed))


def _quota(backend: str, scripts: list[str], probe: PlanProbe) -> Finding:
    """The scripts in use against the account's real limit (its plan's, or the one a 10037
    named), and on the worker pool how many slots Sigil can really use: the account's limit,
    less the scripts that are not Sigil's (or the owner's reserve, if more), Sigil's own and
    the margin."""
    limit = probe.script_limit
    if limit is None:  # the plan could not be told: take the owner's word
        limit, source = settings.SIGIL_POOL_TOTAL_QUOTA, "as SIGIL_POOL_TOTAL_QUOTA states it"
    else:
        source = f"the {probe.plan} plan's" if probe.plan and not probe.limit else "as Cloudflare's refusal named it"
    front = {"platform": settings.SIGIL_PLATFORM_DISPATCHER, "loader": settings.SIGIL_LOADER_WORKER}.get(backend)
    sigils = {name for name in scripts if name.startswith(POOL_PREFIX) or name == front}
    others = len(scripts) - len(sigils)
    used = f"{len(scripts)} of the account's {limit} Worker scripts ({source}) are in use, {others} of them not Sigil's"
    if backend != "worker-pool":
        if len(scripts) >= limit and front not in scripts:
            return Finding("scripts", False, f"{used}: no room left for Sigil's Worker {front}")
        return Finding("scripts", True, used)
    configured = pool_slots(
        total_quota=settings.SIGIL_POOL_TOTAL_QUOTA,
        system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
        user_reserved=settings.SIGIL_POOL_USER_RESERVED,
        safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
    )
    usable = pool_slots(
        total_quota=limit,
        system_reserved=settings.SIGIL_POOL_SYSTEM_RESERVED,
        user_reserved=max(others, settings.SIGIL_POOL_USER_RESERVED),
        safety_margin=settings.SIGIL_POOL_SAFETY_MARGIN,
    )
    really = max(0, min(configured, usable))
    if really >= configured:
        return Finding("scripts", True, f"{used}; Sigil can use its {configured} slots")
    detail = (
        f"{used}; Sigil can really use {really} slots, not the {configured} its settings give "
        f"(SIGIL_POOL_TOTAL_QUOTA {settings.SIGIL_POOL_TOTAL_QUOTA}, less SIGIL_POOL_SYSTEM_RESERVED, "
        "SIGIL_POOL_USER_RESERVED and SIGIL_POOL_SAFETY_MARGIN): lower SIGIL_POOL_TOTAL_QUOTA"
        f" to {limit}, or SIGIL_POOL_USER_RESERVED to at least {others}, or the pool pages out on Cloudflare's "
        "refusals (10037)"
    )
    # A pool with no slot at all cannot work; one with fewer works, paging out more.
    return Finding("scripts", False, detail, blocking=really < 1)
