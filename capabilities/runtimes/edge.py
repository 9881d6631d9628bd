"""The edge on a Cloudflare account: callers' calls served in Sigil's own Worker from what Sigil
publishes in Workers KV (`edge/edge.js`), with the owner's server as the origin for the rest.

The edge module is uploaded beside the Worker of Sigil's that stands in front of the
capabilities (the platform's dispatch Worker, the loader's loader Worker), which hands it
callers' requests; the worker-pool runtime has no such Worker, so it gets one of its own,
`sigil-edge` (SIGIL_EDGE_WORKER), reaching pooled scripts by their workers.dev URLs. This
module holds what each of them is uploaded with for the edge (its KV namespace is the one the
publisher writes, found by NamedKv), the URL callers reach it at, and what `cfcheck` says the
edge needs of the account.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import LazySettings
from django.core.checks import CheckMessage, Error

from capabilities.log_limits import LogLimits
from capabilities.record_pushes import RecordsOrigin
from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareError, NamedKv
from capabilities.runtimes.cloudflare.account import Finding
from capabilities.runtimes.cloudflare.kv import kv_namespace_find
from capabilities.runtimes.sigil_worker import SigilWorker
from capabilities.workerd.config import HOST_DIR
from sigil.edge_handoff import handoff_key

_HERE = Path(__file__).resolve().parent / "edge"
EDGE_MODULE = "edge.js"
EDGE_SOURCE = (_HERE / EDGE_MODULE).read_text()
# The report channel (the Workers' batches to the origin), which the edge's reports travel by.
CHANNEL_MODULE = "channel.js"
CHANNEL_SOURCE = (HOST_DIR / CHANNEL_MODULE).read_text()
# The worker-pool runtime's edge Worker: its entry module, in front of the edge module.
EDGE_WORKER_MODULE = "edge-worker.js"
EDGE_WORKER_SOURCE = (_HERE / EDGE_WORKER_MODULE).read_text()
# The plain_text binding that turns a Worker's edge on (its entry hands callers' requests to edge.js).
EDGE_SWITCH = "SIGIL_EDGE"
# Without it Cloudflare refuses a Worker's fetch of another Worker on the account's workers.dev
# zone (error 1042); with it the fetch goes through Cloudflare's front door (reference: Workers
# docs, compatibility flags). The worker-pool's edge reaches pooled scripts so.
STRICTLY_PUBLIC = "global_fetch_strictly_public"


@dataclass(frozen=True)
class EdgeSettings:
    """What the edge is built with, from settings; None from `from_settings` while it is off."""

    origin_url: str
    kv_title: str
    url: str  # a custom domain's base; "" for the edge Worker's workers.dev URL
    worker: str  # the worker-pool runtime's edge Worker
    max_body_bytes: int
    timeout_seconds: float
    breaker_cooldown_seconds: float
    cpu_ms: int
    pool_redirect: bool
    # The report channel's bounds (LogLimits.for_host): what a batch holds, what an isolate spools.
    channel_limits: dict

    @classmethod
    def from_settings(cls) -> EdgeSettings | None:
        from django.conf import settings

        if not settings.SIGIL_EDGE:
            return None
        return cls(
            origin_url=settings.SIGIL_ORIGIN_URL.rstrip("/"),
            kv_title=settings.SIGIL_EDGE_KV_TITLE,
            url=settings.SIGIL_EDGE_URL.rstrip("/"),
            worker=settings.SIGIL_EDGE_WORKER,
            max_body_bytes=settings.SIGIL_INVOKE_MAX_BODY_BYTES,
            timeout_seconds=settings.SIGIL_INVOKE_TIMEOUT_SECONDS,
            breaker_cooldown_seconds=settings.SIGIL_BREAKER_COOLDOWN_SECONDS,
            cpu_ms=settings.SIGIL_CPU_MS,
            pool_redirect=settings.SIGIL_POOL_REDIRECT,
            channel_limits=LogLimits.from_settings().for_host(),
        )


class Edge:
    """One runtime's edge: what the Worker carrying it is uploaded with. Its KV namespace, the
    one the edge's state is published in (capabilities/services/edge.py), is found or created
    on first use, for every process."""

    def __init__(self, *, client: CloudflareClient, settings: EdgeSettings, backend: str, secret: str) -> None:
        self.client = client
        self.settings = settings
        self.backend = backend
        self.kv = NamedKv(client=client, title=settings.kv_title)
        self._key = handoff_key(secret)
        # Where the edge pushes its reports: the origin's endpoint for call records, signed alike.
        self.reports = RecordsOrigin.at(settings.origin_url, secret=secret)

    def modules(self) -> dict[str, str]:
        return {EDGE_MODULE: EDGE_SOURCE, CHANNEL_MODULE: CHANNEL_SOURCE}

    def bindings(self) -> list[dict]:
        """The edge's own bindings: its KV, the switch, where the origin is, the engine's limits,
        and where its reports go with the channel's bounds (LOG_LIMITS)."""
        text = {
            EDGE_SWITCH: "true",
            "SIGIL_BACKEND": self.backend,
            "SIGIL_ORIGIN_URL": self.settings.origin_url,
            "SIGIL_INVOKE_MAX_BODY_BYTES": str(self.settings.max_body_bytes),
            "SIGIL_INVOKE_TIMEOUT_SECONDS": f"{self.settings.timeout_seconds:g}",
            "SIGIL_BREAKER_COOLDOWN_SECONDS": f"{self.settings.breaker_cooldown_seconds:g}",
            "SIGIL_CPU_MS": str(self.settings.cpu_ms),
            "LOG_LIMITS": json.dumps(self.settings.channel_limits),
        }
        return [
            {"type": "kv_namespace", "name": "EDGE_KV", "namespace_id": self.kv.id},
            *({"type": "plain_text", "name": name, "text": value} for name, value in text.items()),
            *self.reports.bindings(),
        ]

    def secret_bindings(self) -> list[dict]:
        return [{"type": "secret_text", "name": "SIGIL_EDGE_KEY", "text": self._key}, *self.reports.secret_bindings()]

    def url(self, worker: SigilWorker) -> str:
        """The base of the URLs callers reach capabilities at: the custom domain's, else the
        edge Worker's workers.dev URL (its door on the emulator). Asks for the account's
        subdomain once per process. Raises the client's errors."""
        return self.settings.url or worker.caller_url

    def pool_worker(self, *, guard_secret: str, subdomain: str, invoke_base: str) -> SigilWorker:
        """The worker-pool runtime's edge Worker, reaching pooled scripts on `subdomain`."""
        return SigilWorker(
            client=self.client,
            name=self.settings.worker,
            modules={EDGE_WORKER_MODULE: EDGE_WORKER_SOURCE, **self.modules()},
            main_module=EDGE_WORKER_MODULE,
            bindings=[
                *self.bindings(),
                {"type": "plain_text", "name": "SIGIL_WORKERS_SUBDOMAIN", "text": subdomain},
                {"type": "plain_text", "name": "SIGIL_POOL_REDIRECT", "text": str(self.settings.pool_redirect).lower()},
            ],
            secret_bindings=[
                *self.secret_bindings(),
                {"type": "secret_text", "name": "SIGIL_GUARD_SECRET", "text": guard_secret},
            ],
            version_binding="SIGIL_EDGE_VERSION",
            compatibility_flags=[STRICTLY_PUBLIC],
            invoke_base=invoke_base,
            probe_header="x-sigil-pool-secret",
        )


def edge_settings_errors(settings: LazySettings) -> list[CheckMessage]:
    """With the edge on, its Workers must have an origin to send what they cannot serve to."""
    if not settings.SIGIL_EDGE:
        return []
    errors = []
    origin = urlsplit(settings.SIGIL_ORIGIN_URL)
    if not settings.SIGIL_ORIGIN_URL:
        hint = "Set SIGIL_ORIGIN_URL to this server's public URL, or set SIGIL_EDGE=false."
        errors.append(Error("SIGIL_EDGE is on and SIGIL_ORIGIN_URL is empty", hint=hint, id="sigil.E040"))
    elif origin.scheme not in ("http", "https") or not origin.hostname or origin.path.strip("/"):
        hint = "Give the scheme and host of this server only, such as https://sigil.example.com."
        errors.append(Error(f"SIGIL_ORIGIN_URL {settings.SIGIL_ORIGIN_URL!r} is no origin", hint=hint, id="sigil.E041"))
    edge = urlsplit(settings.SIGIL_EDGE_URL)
    if settings.SIGIL_EDGE_URL and (edge.scheme not in ("http", "https") or not edge.hostname):
        hint = "Give the scheme and host of the custom domain routed to the edge Worker, or leave it empty."
        errors.append(Error(f"SIGIL_EDGE_URL {settings.SIGIL_EDGE_URL!r} is no URL", hint=hint, id="sigil.E042"))
    return errors


def edge_account_findings(*, client: CloudflareClient, settings: LazySettings) -> list[Finding]:
    """What the edge needs of the account, for `cfcheck`: its KV namespace, and an origin URL
    Cloudflare can reach (an account on this machine, the emulator's, reaches loopback;
    Cloudflare does not). The workers.dev subdomain its URL is on is cfcheck's own finding.
    Reads only."""
    emulated = urlsplit(client.base_url).hostname in ("127.0.0.1", "localhost", "::1")
    if not settings.SIGIL_EDGE:
        return []  # every call goes through this server: the edge needs nothing of the account
    findings = []
    try:
        found = kv_namespace_find(client, settings.SIGIL_EDGE_KV_TITLE)
    except CloudflareError as exc:
        detail = f"the token cannot list the account's KV namespaces ({exc})"
        findings.append(Finding("edge KV namespace", False, detail))
    else:
        where = "exists" if found else "is created when Sigil starts"
        findings.append(Finding("edge KV namespace", True, f"{settings.SIGIL_EDGE_KV_TITLE} {where}"))
    findings.append(origin_finding(settings.SIGIL_ORIGIN_URL, emulated=emulated))
    return findings


def origin_finding(origin_url: str, *, emulated: bool) -> Finding:
    """Whether Cloudflare can reach `origin_url` (`emulated`: the account is on this machine)."""
    topic = "edge origin"
    if not origin_url:
        return Finding(topic, False, "SIGIL_ORIGIN_URL is empty: the edge has nowhere to send what it cannot serve")
    host = urlsplit(origin_url).hostname or ""
    if emulated:
        return Finding(topic, True, f"{origin_url} (the emulator's Workers reach this machine)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    local = host == "localhost" or host.endswith((".localhost", ".local", ".internal"))
    if local or (address is not None and not address.is_global):
        return Finding(
            topic,
            False,
            f"{origin_url} is not on the Internet, so Cloudflare cannot reach it: give this server's public "
            "URL (a tunnel's, or behind a proxy) in SIGIL_ORIGIN_URL",
        )
    if not origin_url.startswith("https://"):
        return Finding(topic, False, f"{origin_url}: calls would travel unencrypted; prefer https", blocking=False)
    return Finding(topic, True, f"{origin_url}")
