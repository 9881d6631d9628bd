"""The runtime interface: where capability code is placed, and how a request reaches it."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import LazySettings
from django.core.checks import CheckMessage

from capabilities.runtimes.billing import Prices, RuntimeBill, Usage

# The errors live in their own module; importers of them from here keep working.
from capabilities.runtimes.errors import (  # noqa: F401
    RuntimeFailure,
    RuntimeRejected,
    RuntimeUnavailable,
    ScriptTooLarge,
    SlotsExhausted,
)
from capabilities.sealing import bundle_seal_key


@dataclass(frozen=True)
class ResolvedBinding:
    """One binding as a runtime gives it: kind (VAR, SECRET, KV, ...), its name in `env`,
    and its value (a resource id, or the text of a variable or secret).

    A secret also carries its `fingerprint` (`secret_fingerprint` under a key of Sigil's),
    which stands for the value wherever a bundle's identity is computed.
    """

    kind: str
    name: str
    value: str = field(repr=False)
    fingerprint: str = ""

    @property
    def declaration(self) -> str:
        return f"{self.kind}:{self.name}"


# The kinds that become plain values in `env` rather than resources.
TEXT_BINDING_KINDS = frozenset({"VAR", "SECRET"})
SECRET_KIND = "SECRET"


def secret_fingerprint(value: str, *, key: str) -> str:
    """A keyed digest of a secret: changes with the value, and reveals nothing without `key`."""
    return hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class CodeBundle:
    """What a runtime places: one ES module Worker and the bindings it declared.

    `sha` covers the code, the variables and the secrets' fingerprints, so it changes with
    the code and with any binding value; with the capability's full name it forms the
    loader id, so a new version (or a rotated secret) always gets a fresh isolate.

    The stored form (`to_json`) never holds a secret in plain text: secrets are sealed with
    AES-256-GCM under a key derived from the loader host's own secret, bound to `sha`, and
    opened by the host when it loads the code (runtimes/host/host.js).
    """

    main_module: str
    modules: dict[str, str]
    compatibility_date: str = "2025-01-01"
    bindings: tuple[ResolvedBinding, ...] = ()
    # The capability's own CPU limit per call in ms (None: the runtime's default). Not part
    # of `sha`: the same code with another limit is the same code. A runtime that fixes the
    # limit at upload (worker-pool's `limits.cpu_ms`) reads it here; the others per call.
    cpu_ms: int | None = field(default=None, compare=False)
    # The capability version this code is, for runtimes whose placed code names it in every
    # answer (SERVED_VERSION_HEADER): one slot's code is replaced in place there, so the
    # route's version alone may be the previous one's for a moment. Not part of `sha`, nor
    # of the stored form: the code is the same whichever version carries it.
    version: int | None = field(default=None, compare=False)
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        identity = self._public()
        if self.secrets:
            identity["secrets"] = {b.name: b.fingerprint for b in self.bindings if b.kind == SECRET_KIND}
            if not all(identity["secrets"].values()):
                raise ValueError("a secret binding needs its fingerprint")
        object.__setattr__(self, "sha", hashlib.sha256(_canonical(identity)).hexdigest())

    @classmethod
    def from_code(
        cls,
        code: str,
        *,
        bindings: tuple[ResolvedBinding, ...] | list[ResolvedBinding] = (),
        cpu_ms: int | None = None,
        version: int | None = None,
    ) -> CodeBundle:
        return cls(
            main_module="main.js", modules={"main.js": code}, bindings=tuple(bindings), cpu_ms=cpu_ms, version=version
        )

    @property
    def secrets(self) -> dict[str, str]:
        """The secret bindings' values, as the loader host puts them in `env`."""
        return {b.name: b.value for b in self.bindings if b.kind == SECRET_KIND}

    def masked(self, text: str) -> str:
        """`text` with each of the bundle's secret values replaced by `[secret NAME]` (the
        longest first): for what a runtime says of the code, which quotes what it threw."""
        for name, value in sorted(self.secrets.items(), key=lambda item: -len(item[1])):
            if value:
                text = text.replace(value, f"[secret {name}]")
        return text

    def _public(self) -> dict:
        return {
            "mainModule": self.main_module,
            "modules": self.modules,
            "compatibilityDate": self.compatibility_date,
            "env": {b.name: b.value for b in self.bindings if b.kind in TEXT_BINDING_KINDS - {SECRET_KIND}},
        }

    def to_json(self, *, seal_key: str | None = None) -> bytes:
        """The stored form read by the loader host whose SIGIL_SECRET is `seal_key`: code,
        variables, and the secrets sealed (a fresh nonce each time, so not deterministic).
        Raises ValueError for a bundle with secrets and no `seal_key`: none is stored in clear."""
        stored = self._public()
        if self.secrets:
            if not seal_key:
                raise ValueError("a bundle with secrets is stored only sealed: give seal_key")
            nonce = os.urandom(12)
            sealed = AESGCM(bundle_seal_key(seal_key)).encrypt(nonce, _canonical(self.secrets), self.sha.encode())
            stored["sealed"] = base64.b64encode(nonce + sealed).decode()
        return _canonical(stored)


# The response header with which placed code names the capability version it is, on
# runtimes whose slot is overwritten in place by a redeploy (worker-pool's guard). Where a
# route names the code's sha (local, loader), the route's version is the answering code's.
SERVED_VERSION_HEADER = "x-sigil-served-version"


def _canonical(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def code_sha(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


@dataclass(frozen=True)
class Route:
    """How the engine reaches placed code: a base URL and the headers to add.

    Computed once per placement and cached by the engine, so it must be cheap and plain.
    """

    base_url: str
    headers: tuple[tuple[str, str], ...] = ()
    host_header: str | None = None
    #: send the caller there with a 302 instead of forwarding the call
    redirect: bool = False


@dataclass(frozen=True)
class CallStopped:
    """A call whose runtime process stopped under it: stopped for running past a limit, or
    exited on its own.

    `culprit` says whether this call can be the one that ran past it (else it merely
    shared the process, or arrived while it restarted); `reason` is "cpu", "memory",
    "starved" (silent while the host did not run it) or "exited"; `message` completes
    "{capability} ..." ("ran past its CPU limit of 1000 ms").
    """

    culprit: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Process:
    """A program a runtime needs on this machine, which `manage.py runsigil` runs as
    `manage.py {command}` and restarts when it dies. Each runs workerd (SIGIL_WORKERD_BIN)."""

    name: str  # in runsigil's output, and on the program's log lines
    command: str
    port: int  # where it serves, which must be free before it starts
    port_name: str  # the port in words, for the refusal when it is taken ("workerd's port")
    port_hint: str  # what else the owner may do then ("set SIGIL_WORKERD_PORT")
    description: str  # the line runsigil says about it when it starts
    ready: Callable[[], bool] | None = None  # None: once its port answers


class Runtime(ABC):
    """One place where capability code runs. Subclasses read settings only in __init__.

    The class states the runtime's facts without being built (its class methods, given the
    settings): whether it is on Cloudflare, its system checks, what it would bill, and the
    processes it needs on this machine; callers ask it rather than test its name.

    `tenant`, given with a slot, is the agent the capability there belongs to: a runtime that
    keeps agents apart (a process, or a tag, per agent) reads it there, never in the slot.
    """

    #: the value of SIGIL_BACKEND that selects this runtime (its key in RUNTIMES)
    name: str = ""
    #: whether it runs on a Cloudflare account (the CF_* settings, `manage.py cfcheck`)
    on_cloudflare: bool = False

    @classmethod
    @abstractmethod
    def from_settings(cls) -> Runtime:
        """This runtime as Sigil's settings describe it: the one place a runtime reads them."""

    @classmethod
    def settings_errors(cls, settings: LazySettings) -> list[CheckMessage]:
        """What is wrong with `settings` for this runtime, as Django's system checks report
        it; asked at start of the runtime SIGIL_BACKEND names."""
        return []

    @classmethod
    def settings_warnings(cls, settings: LazySettings) -> list[str]:
        """What `settings` leave this runtime without, though it serves (call records that
        cannot arrive), in plain words for `/_health`'s warnings and `cfcheck`."""
        return []

    @classmethod
    def processes(cls, settings: LazySettings) -> list[Process]:
        """The programs this runtime needs on this machine beside Sigil's own (web, worker,
        Redis), in the order they start."""
        return []

    @classmethod
    def where(cls, settings: LazySettings) -> list[str]:
        """Where this runtime's code runs, in words, for runsigil's first lines."""
        return [process.description for process in cls.processes(settings)]

    @classmethod
    def bills(cls, usage: Usage, prices: Prices, *, smallest_slots: int | None) -> list[RuntimeBill]:
        """What a month of `usage` would cost on this runtime at `prices`: a bill for each
        plan it can run on (`smallest_slots`: the fewest slots that kept cold calls under
        1 %, None when unknown). None for a runtime that costs only its machine."""
        return []

    @property
    def total_slots(self) -> int | None:
        """How many capabilities can be live at once; None means no limit (no paging)."""
        return None

    @property
    def safety_margin(self) -> int:
        """Scripts allowed beyond total_slots while victims are deleted in the background."""
        return 0

    #: binding kinds this runtime can give a capability; None means every kind
    binding_kinds: frozenset[str] | None = None

    #: a deploy hands the placement to a Celery task rather than placing in the web request:
    #: Cloudflare's latency and the rate budget's waits then hold a worker, not a web thread
    places_in_background: bool = False

    @abstractmethod
    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        """The runtime's name for a capability's placement. Pure and stable; a higher
        `attempt` gives another name, for when the first is taken."""

    @abstractmethod
    def place(self, *, slot: str, bundle: CodeBundle, tenant: str) -> None:
        """Make `bundle` the code served at `slot`, for `tenant`.

        Idempotent: placing the same bundle again changes nothing. Raises RuntimeUnavailable
        (transient), ScriptTooLarge, SlotsExhausted or RuntimeRejected.
        """

    @abstractmethod
    def remove(self, *, slot: str) -> None:
        """Stop serving `slot` and free its room. Removing a missing slot is not an error. The
        slot's tenant, where the runtime needs it, is in the runtime's own record of the slot
        (a slot no capability holds any more is removed too)."""

    @abstractmethod
    def route(self, *, slot: str, sha: str, tenant: str, cpu_ms: int | None = None) -> Route:
        """Where the engine sends requests for `tenant`'s `slot` running code `sha`. No I/O.

        `cpu_ms` is the capability's own CPU limit per call (None: the runtime's default);
        runtimes that cannot enforce one ignore it.

        WebSockets pass as on Cloudflare: a GET with `Upgrade: websocket` (and `Connection:
        Upgrade`, the `Sec-WebSocket-*` fields) sent there with the route's headers and Host
        reaches the code with its upgrade; the code's `101` comes back with its own headers
        (the chosen subprotocol, the runtime's marker), then frames both ways on that
        connection. An answer that is no 101 reads as any other (`is_missing` included).
        """

    def is_missing(self, response) -> bool:
        """Whether an upstream response says the placed script is gone (a miss, not an error).

        The loader host marks it; runtimes whose upstream says it differently override this.
        """
        return response.status == 404 and response.headers.get("x-sigil-error") == "missing-code"

    def call_stopped(self, *, slot: str, tenant: str, sent_at: float) -> CallStopped | None:
        """Why a call to `tenant`'s `slot` sent at `sent_at` (epoch) lost its connection, when the
        runtime stopped its process for a limit; None when it did not (a plain failure).

        Asked only after a failed call, so it may read local state. Runtimes whose limits
        are enforced upstream (Cloudflare answers them itself) keep this default.
        """
        return None

    def stopped_at_limits(self, response) -> bool:
        """Whether an unmarked 503 is the runtime's own answer for code it stopped at its
        limits (Cloudflare's error 1102), not the capability's. Only runtimes whose Worker
        marks every answer it passes on can tell; the others say no."""
        return False

    def failed_itself(self, response) -> bool:
        """Whether a 5xx is the runtime's own failure (Cloudflare's error page for its own
        side failing), neither the capability's answer nor its stop at its limits
        (`stopped_at_limits`): it is then the runtime's failure, never the capability's. Only
        runtimes whose Worker marks every answer it passes on can tell; the others say no."""
        return False

    @abstractmethod
    def list_slots(self) -> list[str]:
        """The slots this runtime holds that Sigil manages. Raises RuntimeUnavailable."""

    def created_here(self, *, slot: str) -> bool:
        """Whether this Sigil installation created `slot`, asked before reconcile or a switch
        deletes a slot no capability holds. Runtimes that share a place with the owner's own
        scripts (a Cloudflare account) look for the installation's tag; the others hold only
        Sigil's. Raises RuntimeUnavailable."""
        return True

    @abstractmethod
    def check(self) -> None:
        """Raise RuntimeUnavailable when the runtime cannot serve; for health checks."""

    def api_waits_shared(self) -> contextlib.AbstractContextManager:
        """The block's calls to the runtime's API wait for their rate budget within one
        allowance in all (a page-in makes several), not one each. Runtimes whose API has no
        budget keep this default: nothing to share."""
        return contextlib.nullcontext()

    def edge_url(self) -> str | None:
        """The base of the URLs callers reach capabilities at through Sigil's edge on the
        runtime's provider (`{base}/{agent}/{name}`), None when calls go through Sigil's own
        server only. May ask the provider once per process (an account's subdomain). Raises
        RuntimeUnavailable."""
        return None

    def provision(self) -> list[str]:
        """Create what the runtime needs besides capabilities (a namespace, Sigil's own Worker).

        Idempotent: what exists and is current is left alone. Returns one line per thing
        created or updated, for the owner. Raises RuntimeUnavailable or RuntimeRejected.
        """
        return []
