"""Sigil's own Worker on a Cloudflare account (the platform runtime's dispatch Worker, the
loader runtime's loader Worker): deployed when missing or stale, probed over HTTP."""

from __future__ import annotations

import hashlib
import json
import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import urllib3
from django.conf import LazySettings

from capabilities.runtimes.base import Route
from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareNotFound
from capabilities.runtimes.cloudflare.account import CloudflareRuntime, Finding, PlanProbe, scripts_in_use
from capabilities.runtimes.cloudflare.facts import SUBDOMAIN, AccountFacts
from capabilities.runtimes.errors import RuntimeUnavailable, network_failure
from sigil import redis_keys
from sigil.leases import Lease

# The plain-text binding that carries the deployed source's version, and the header the
# Worker echoes it in when it refuses a request without Sigil's secret.
VERSION_HEADER = "x-sigil-version"
SYSTEM_TAG = "sigil-system"
# How long a deploy of Sigil's Worker may hold, or wait for, the lock that makes it one.
DEPLOY_LOCK_SECONDS = 120


class SigilWorker:
    """One Worker script of Sigil's, named `name`, reached on its workers.dev URL.

    `version` is a hash of everything uploaded (modules, bindings, compatibility date, and
    a hash of the secrets, so that a rotated secret is deployed too), kept in the plain-text
    binding `version_binding`: `deploy` uploads only when the deployed version differs, and
    `probe` checks the running one without an API call, sending `probe_header` (the header
    that marks Sigil's own requests to it, empty, so refused) when it names one: a Worker
    serving callers (the edge) answers requests without it as calls. With `invoke_base` set
    (the emulator) requests go to that base URL with the workers.dev name in the Host header.
    """

    def __init__(
        self,
        *,
        client: CloudflareClient,
        name: str,
        modules: Mapping[str, str],
        main_module: str,
        bindings: Sequence[Mapping[str, Any]],
        secret_bindings: Sequence[Mapping[str, Any]],
        version_binding: str,
        compatibility_date: str = "2025-01-01",
        compatibility_flags: Sequence[str] = (),
        tail_consumers: Sequence[Mapping[str, str]] = (),
        invoke_base: str = "",
        probe_header: str = "",
    ) -> None:
        self.client = client
        self.probe_header = probe_header
        self.tail_consumers = [dict(c) for c in tail_consumers]
        self.name = name
        self.modules = dict(modules)
        self.main_module = main_module
        self.bindings = [dict(b) for b in bindings]
        self.secret_bindings = [dict(b) for b in secret_bindings]
        self.version_binding = version_binding
        self.compatibility_date = compatibility_date
        self.compatibility_flags = list(compatibility_flags)
        self.invoke_base = invoke_base.rstrip("/")
        secrets = hashlib.sha256(json.dumps(self.secret_bindings, sort_keys=True).encode()).hexdigest()
        stamp = [self.modules, self.main_module, self.bindings, compatibility_date, secrets]
        if self.compatibility_flags:  # so that a Worker without flags keeps the version it had
            stamp.append(self.compatibility_flags)
        if self.tail_consumers:  # likewise
            stamp.append(self.tail_consumers)
        stamp = json.dumps(stamp, sort_keys=True)
        self.version = hashlib.sha256(stamp.encode()).hexdigest()[:16]
        self.facts = AccountFacts(client)
        self._probe = urllib3.PoolManager(timeout=urllib3.Timeout(connect=3.0, read=10.0), retries=False)

    def deployed_version(self) -> str | None:
        """The version the account runs now, None when the script is not there. One API call."""
        try:
            settings = self.client.script_settings_get(self.name)
        except CloudflareNotFound:
            return None
        for binding in settings.get("bindings") or []:
            if binding.get("name") == self.version_binding and binding.get("type") == "plain_text":
                return binding.get("text")
        return ""

    def deploy(self) -> bool:
        """Upload the Worker and turn its workers.dev URL on, unless the current version runs.

        Returns whether it uploaded. Idempotent, and once across processes: every process
        checks on its first placement, and those starting together wait for the one
        uploading. Raises the client's errors, RuntimeUnavailable when that one takes too long.
        """
        lock = Lease(
            redis_keys.sigil_worker_lock(self.client.account_id, self.name),
            hold_seconds=DEPLOY_LOCK_SECONDS,
            blocking_timeout=DEPLOY_LOCK_SECONDS,
        )
        if not lock.acquire():
            raise RuntimeUnavailable(f"another process has been deploying {self.name} for {DEPLOY_LOCK_SECONDS} s")
        try:
            if self.deployed_version() == self.version:
                return False
            version = {"type": "plain_text", "name": self.version_binding, "text": self.version}
            self.client.script_upload(
                self.name,
                modules=self.modules,
                main_module=self.main_module,
                compatibility_date=self.compatibility_date,
                compatibility_flags=self.compatibility_flags,
                bindings=[*self.bindings, *self.secret_bindings, version],
                tags=[SYSTEM_TAG],
                tail_consumers=self.tail_consumers,
            )
            self.client.script_subdomain_set(self.name, enabled=True)
            return True
        finally:
            lock.release()

    @property
    def subdomain(self) -> str:
        """The account's workers.dev subdomain, as every process keeps it (AccountFacts): no API
        request once any process has learnt it."""
        return self.facts.subdomain()

    @property
    def caller_url(self) -> str:
        """Where callers reach this Worker: its workers.dev URL, or on the emulator (`invoke_base`)
        the emulator's door for that name, which needs no Host header (docs/cloudflare.md)."""
        host = f"{self.name}.{self.subdomain}.workers.dev"
        return f"{self.invoke_base}/{host}" if self.invoke_base else f"https://{host}"

    def route(self, headers: tuple[tuple[str, str], ...]) -> Route:
        host = f"{self.name}.{self.subdomain}.workers.dev"
        if self.invoke_base:
            return Route(base_url=self.invoke_base, headers=headers, host_header=host)
        return Route(base_url=f"https://{host}", headers=headers)

    def probe(self) -> None:
        """Call the Worker without Sigil's secret: it must refuse with 403 and say it runs the
        current version. Raises RuntimeUnavailable naming what is wrong."""
        route = self.route(((self.probe_header, ""),) if self.probe_header else ())
        headers = dict(route.headers)
        if route.host_header:
            headers["Host"] = route.host_header
        try:
            response = self._probe.request("GET", route.base_url + "/", headers=headers)
        except urllib3.exceptions.HTTPError as exc:
            raise RuntimeUnavailable(f"Sigil's Worker {self.name} is not reachable: {network_failure(exc)}") from exc
        hint = "run `python manage.py deployruntime`"
        if response.status != 403 or response.headers.get("x-sigil-error") != "forbidden":
            raise RuntimeUnavailable(f"Sigil's Worker {self.name} answered {response.status}, not its 403: {hint}")
        running = response.headers.get(VERSION_HEADER, "")
        if running != self.version:
            raise RuntimeUnavailable(
                f"Sigil's Worker {self.name} runs version {running or 'unknown'}, not {self.version}: {hint}"
            )


class FrontedRuntime(CloudflareRuntime):
    """A runtime whose calls all enter through one Worker of Sigil's (the platform's dispatch
    Worker, the loader Worker), which `provision` deploys on a process's first placement.

    That Worker marks every answer it passes on with `marker_header`, and answers
    "missing-code" when the capability's code is gone. A 404 with neither did not come
    through it: the Worker itself is gone, so the placement that follows provisions again.
    """

    marker_header: str = ""
    places_in_background = True

    def __init__(self, *, cpu_ms: int) -> None:
        self.default_cpu_ms = cpu_ms
        self._provisioned = False
        # Set when a call met a 404 that did not come through Sigil's Worker: the Worker is gone,
        # or the workers.dev subdomain kept for the account is no longer its own. The placement
        # that follows provisions again, and asks for the subdomain again.
        self._front_doubted = False
        self._provision_lock = threading.Lock()

    @property
    @abstractmethod
    def front(self) -> SigilWorker:
        """Sigil's Worker in front of the capabilities."""

    @classmethod
    @abstractmethod
    def front_name(cls, settings: LazySettings) -> str:
        """The name of Sigil's Worker in front, as `settings` give it."""

    @classmethod
    @abstractmethod
    def plan_finding(cls, *, client: CloudflareClient, probe: PlanProbe, settings: LazySettings) -> Finding:
        """Whether the account's plan has what this runtime needs (for `cfcheck`)."""

    @classmethod
    def account_findings(
        cls, *, client: CloudflareClient, probe: PlanProbe, scripts: list[str], settings: LazySettings
    ) -> list[Finding]:
        """The plan's finding, and whether the account has room for Sigil's Worker in front."""
        plan = cls.plan_finding(client=client, probe=probe, settings=settings)
        front = cls.front_name(settings)
        count = scripts_in_use(scripts, probe, settings=settings)
        if len(scripts) >= count.limit and front not in scripts:
            return [plan, Finding("scripts", False, f"{count.used}: no room left for Sigil's Worker {front}")]
        return [plan, Finding("scripts", True, count.used)]

    def _ensure_provisioned(self) -> None:
        if self._provisioned:
            return
        with self._provision_lock:
            if self._front_doubted:
                self._front_doubted = False
                self.front.facts.forget(SUBDOMAIN)
            if not self._provisioned:
                self.provision()

    def _front_route(self, headers: list[tuple[str, str]], cpu_ms: int | None) -> Route:
        limit = cpu_ms or self.default_cpu_ms
        if limit:
            headers.append(("X-Sigil-Cpu-Ms", str(limit)))
        return self.front.route(tuple(headers))

    def is_missing(self, response) -> bool:
        if response.status != 404:
            return False
        if response.headers.get("x-sigil-error") == "missing-code":
            return True
        if self.marker_header not in response.headers:
            self._provisioned = False
            self._front_doubted = True
            return True
        return False

    def passed_on(self, response) -> bool:
        # Sigil's Worker marks what it passes on and names its own refusals.
        return self.marker_header in response.headers or "x-sigil-error" in response.headers

    def check(self) -> None:
        self.front.probe()
