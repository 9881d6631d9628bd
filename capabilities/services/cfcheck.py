"""Whether a Cloudflare account can run a Cloudflare runtime, checked before an owner switches
to it: the API token, the account, its workers.dev subdomain, the plan's features the runtime
needs, the script quota and what the edge needs (SIGIL_EDGE), each reported in plain words
(`manage.py cfcheck`)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from django.conf import settings

from capabilities.runtimes import RUNTIMES, runtime_class
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.cloudflare import (
    CloudflareAuthFailure,
    CloudflareClient,
    CloudflareError,
    CloudflareNotFound,
    CloudflareRateLimited,
    CloudflareRejected,
    CloudflareSlotsExhausted,
    CloudflareUnavailable,
)
from capabilities.runtimes.cloudflare.account import FREE_PLAN, PAID_PLAN, PLAN_PROBE_WORKER, Finding, PlanProbe
from capabilities.runtimes.edge import edge_account_findings

# The runtimes that run on a Cloudflare account.
CLOUDFLARE_BACKENDS = tuple(name for name in RUNTIMES if runtime_class(name).on_cloudflare)
# A throwaway Worker that asks the account whether its plan allows a worker_loader binding:
# no read-only endpoint says so, and Cloudflare refuses such an upload on the free plan
# (reference §5.1: 10021 "binding LOADER of type worker_loader is invalid", or 10195).
LOADER_PROBE_SCRIPT = PLAN_PROBE_WORKER
LOADER_PROBE_MODULE = "probe.js"
LOADER_PROBE_SOURCE = 'export default { fetch() { return new Response("") } }\n'
# Cloudflare's codes for a binding or feature the plan does not include (reference §7.1).
PLAN_REFUSAL_CODES = frozenset({10021, 10075, 10195})
# Cloudflare's 10037 names the limit: "You have exceeded the limit of 500 Workers on your account."
_LIMIT_IN_REFUSAL = re.compile(r"limit of (\d+) Workers")


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

    # Housekeeping in the API budget's order: it never takes room calls and deploys wait for.
    with api_work(ApiClass.HOUSEKEEPING):
        return _checked(client, backend, findings, done)


def _checked(client: CloudflareClient, backend: str, findings: list[Finding], done) -> CloudflareCheck:
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
        runtime = runtime_class(backend)
        findings.extend(runtime.account_findings(client=client, probe=probe, scripts=scripts, settings=settings))
        findings.extend(
            Finding("call records", False, warning, blocking=False) for warning in runtime.settings_warnings(settings)
        )
        findings.extend(edge_account_findings(client=client, settings=settings))
    except CloudflareRateLimited as exc:
        detail = f"no API request could be made, so nothing more is known: {exc.why or exc}; run it again then"
        findings.append(Finding("Cloudflare", False, detail))
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
