"""The runtime interface: where capability code is placed, and how a request reaches it."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class RuntimeFailure(Exception):
    """Base of every error a runtime raises."""


class RuntimeUnavailable(RuntimeFailure):
    """The runtime could not be reached or failed transiently; retrying may succeed."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RuntimeRejected(RuntimeFailure):
    """The runtime refused the code or the request for good; retrying will not help."""


class ScriptTooLarge(RuntimeRejected):
    """The code is over the runtime's script size limit."""


class SlotsExhausted(RuntimeRejected):
    """The runtime has no room for another script (its quota is reached)."""


@dataclass(frozen=True)
class ResolvedBinding:
    """One binding as a runtime gives it: kind (VAR, SECRET, KV, ...), its name in `env`,
    and its value (a resource id, or the text of a variable or secret)."""

    kind: str
    name: str
    value: str

    @property
    def declaration(self) -> str:
        return f"{self.kind}:{self.name}"


# The kinds that become plain values in `env` rather than resources.
TEXT_BINDING_KINDS = frozenset({"VAR", "SECRET"})


@dataclass(frozen=True)
class CodeBundle:
    """What a runtime places: one ES module Worker and the bindings it declared.

    `sha` is the sha256 of the stored form, so it changes with the code and with any
    binding value; with the capability's full name it forms the loader id, so a new version
    (or a rotated secret) always gets a fresh isolate.
    """

    main_module: str
    modules: dict[str, str]
    compatibility_date: str = "2025-01-01"
    bindings: tuple[ResolvedBinding, ...] = ()
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha256(self.to_json()).hexdigest())

    @classmethod
    def from_code(cls, code: str, *, bindings: tuple[ResolvedBinding, ...] | list[ResolvedBinding] = ()) -> CodeBundle:
        return cls(main_module="main.js", modules={"main.js": code}, bindings=tuple(bindings))

    @property
    def env(self) -> dict[str, str]:
        """The text bindings, as the loader host puts them in `env`."""
        return {b.name: b.value for b in self.bindings if b.kind in TEXT_BINDING_KINDS}

    def to_json(self) -> bytes:
        """The stored form read by the loader host (see runtimes/host/host.js)."""
        return json.dumps(
            {
                "mainModule": self.main_module,
                "modules": self.modules,
                "compatibilityDate": self.compatibility_date,
                "env": self.env,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()


def code_sha(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


@dataclass(frozen=True)
class Route:
    """How the gateway reaches placed code: a base URL and the headers to add.

    Computed once per placement and cached by the gateway, so it must be cheap and plain.
    """

    base_url: str
    headers: tuple[tuple[str, str], ...] = ()
    host_header: str | None = None
    #: send the caller there with a 302 instead of forwarding the call
    redirect: bool = False


@dataclass(frozen=True)
class CallStopped:
    """A call whose runtime process was stopped under it for running past a limit.

    `culprit` says whether this call can be the one that ran past it (else it merely
    shared the process, or arrived while it restarted); `reason` is "cpu" or "memory";
    `message` completes "{capability} ..." ("ran past its CPU limit of 1000 ms").
    """

    culprit: bool
    reason: str
    message: str


class Runtime(ABC):
    """One place where capability code runs. Subclasses read settings only in __init__."""

    #: the value of SIGIL_BACKEND that selects this runtime
    name: str = ""

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

    @abstractmethod
    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        """The runtime's name for a capability's placement. Pure and stable; a higher
        `attempt` gives another name, for when the first is taken."""

    @abstractmethod
    def place(self, *, slot: str, bundle: CodeBundle) -> None:
        """Make `bundle` the code served at `slot`.

        Idempotent: placing the same bundle again changes nothing. Raises RuntimeUnavailable
        (transient), ScriptTooLarge, SlotsExhausted or RuntimeRejected.
        """

    @abstractmethod
    def remove(self, *, slot: str) -> None:
        """Stop serving `slot` and free its room. Removing a missing slot is not an error."""

    @abstractmethod
    def route(self, *, slot: str, sha: str, cpu_ms: int | None = None) -> Route:
        """Where the gateway sends requests for `slot` running code `sha`. No I/O.

        `cpu_ms` is the capability's own CPU limit per call (None: the runtime's default);
        runtimes that cannot enforce one ignore it.
        """

    def is_missing(self, response) -> bool:
        """Whether an upstream response says the placed script is gone (a miss, not an error).

        The loader host marks it; runtimes whose upstream says it differently override this.
        """
        return response.status == 404 and response.headers.get("x-sigil-error") == "missing-code"

    def call_stopped(self, *, slot: str, sent_at: float) -> CallStopped | None:
        """Why a call to `slot` sent at `sent_at` (epoch) lost its connection, when the
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

    @abstractmethod
    def list_slots(self) -> list[str]:
        """The slots this runtime holds that Sigil manages. Raises RuntimeUnavailable."""

    @abstractmethod
    def check(self) -> None:
        """Raise RuntimeUnavailable when the runtime cannot serve; for health checks."""

    def provision(self) -> list[str]:
        """Create what the runtime needs besides capabilities (a namespace, Sigil's own Worker).

        Idempotent: what exists and is current is left alone. Returns one line per thing
        created or updated, for the owner. Raises RuntimeUnavailable or RuntimeRejected.
        """
        return []
