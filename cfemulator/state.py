"""The emulated account's state on disk, so it outlives the emulator's process as a
Cloudflare account outlives any client: scripts (with their uploads), dispatch namespaces,
KV namespaces and values, and the workers.dev subdomain.

It is one pickle, replaced atomically after each change and readable by the emulator's user
only. Secret bindings (`secret_text`, `secret_key`) are sealed in it, as Cloudflare keeps them
encrypted at rest: Fernet (AES-128-CBC and HMAC-SHA256) under a key of the emulator's own,
`account.key` beside the state (mode 0600, made on the first save), and opened when the
account is taken up at start. Settings, counters and logs are not state: they come from the
command line and start afresh.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

from cfemulator.uploads import ScriptUpload, TextBinding
from sigil.files import write_atomically

logger = logging.getLogger(__name__)

# Raised when the shape of the state changes: a file of another version is not read.
# 2: text bindings are the emulator's own (cfemulator.uploads.TextBinding).
# 3: secret bindings are sealed (a version 2 file, whose are not, is still taken up).
STATE_VERSION = 3
_PLAIN_SECRETS_VERSION = 2
KEY_FILE = "account.key"
# Binding types whose values are secrets: everything but their name and type is sealed.
SECRET_BINDING_TYPES = frozenset({"secret_text", "secret_key"})
_SEALED = "sealed"


@dataclass
class Script:
    name: str
    sha: str
    upload: ScriptUpload
    created_on: str
    modified_on: str
    subdomain_enabled: bool = False
    previews_enabled: bool = False
    # Epoch seconds from which the script (first upload) and its workers.dev route (last
    # toggle) are known to the Workers runtime (EmulatorConfig.propagation_delay).
    live_at: float = 0.0
    route_live_at: float = 0.0
    # The deployment the last upload made (a fresh id per upload, as Cloudflare's).
    deployment_id: str = ""
    # Where the last upload stands among all the account's uploads (a later one is higher):
    # a call for a version older than the one served goes to the one served.
    generation: int = 0
    # Its versions, oldest first, and deployments, newest first (cfemulator.api_lifecycle):
    # records only; each version's code is kept in memory, the served one on disk.
    versions: tuple[dict[str, Any], ...] = ()
    deployments: tuple[dict[str, Any], ...] = ()
    # "wrangler" or "api": what made its last deployment (wrangler reads it before a deploy).
    last_deployed_from: str = "api"
    # Script-level settings that are no part of a version.
    logpush: bool = False
    observability: dict[str, Any] | None = None

    def serves(self, now: float) -> bool:
        """Whether the Workers runtime runs it at `now` (its workers.dev URL aside)."""
        return now >= self.live_at

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "etag": self.sha,
            "created_on": self.created_on,
            "modified_on": self.modified_on,
            "usage_model": "standard",
            "logpush": self.logpush,
            "has_modules": True,
            "has_assets": False,
        }


@dataclass
class DispatchNamespace:
    id: str
    name: str
    created_on: str
    modified_on: str
    scripts: dict[str, Script] = field(default_factory=dict)


@dataclass
class KvValue:
    value: bytes
    expiration: int | None
    metadata: Any

    def live(self, now: float) -> bool:
        """Whether it is still there at `now` (not expired)."""
        return self.expiration is None or self.expiration > now


@dataclass
class KvNamespace:
    id: str
    title: str
    values: dict[str, KvValue] = field(default_factory=dict)


@dataclass
class AccountState:
    subdomain: str
    scripts: dict[str, Any]  # name -> Script
    namespaces: dict[str, Any]  # name -> DispatchNamespace
    kv_namespaces: dict[str, Any]  # id -> KvNamespace


class StateSeal:
    """The key that seals the state's secret values: `path`, made (mode 0600) when first
    needed, so a copy of the state alone gives none of them away."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fernet: Fernet | None = None

    @classmethod
    def beside(cls, state_file: Path) -> StateSeal:
        return cls(Path(state_file).with_name(KEY_FILE))

    def seal(self, value: str) -> str:
        return self._key(create=True).encrypt(value.encode()).decode()

    def open(self, token: str) -> str:
        """The value `token` seals. Raises InvalidToken when this key did not seal it, and
        FileNotFoundError when there is no key."""
        return self._key(create=False).decrypt(token.encode()).decode()

    def _key(self, *, create: bool) -> Fernet:
        if self._fernet is None:
            try:
                key = self.path.read_bytes()
            except FileNotFoundError:
                if not create:
                    raise
                key = Fernet.generate_key()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self.path, key)  # owner-only, as mkstemp makes it
            self._fernet = Fernet(key)
        return self._fernet


def save_state(path: Path, state: AccountState) -> None:
    """Replace the state file with `state`, its secrets sealed (write_atomically's files are
    mode 0600). The state itself is left as it is."""
    seal = StateSeal.beside(path)
    sealed = _with_uploads(state, lambda upload: _sealed_upload(upload, seal.seal))
    write_atomically(path, pickle.dumps((STATE_VERSION, sealed), protocol=pickle.HIGHEST_PROTOCOL))


def load_state(path: Path) -> AccountState | None:
    """The state saved at `path`, its secrets opened, or None when there is none or it
    cannot be read, nor its secrets opened (the account then starts empty, as after a reset;
    the reason is logged)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        # The file is the emulator's own, in its own state directory.
        version, state = pickle.loads(data)
    except Exception as exc:  # any unreadable file means: start empty
        logger.warning("the Cloudflare emulator's state in %s cannot be read (%s); starting empty", path, exc)
        return None
    if version not in (STATE_VERSION, _PLAIN_SECRETS_VERSION) or not isinstance(state, AccountState):
        logger.warning("the Cloudflare emulator's state in %s is of another version; starting empty", path)
        return None
    if version == _PLAIN_SECRETS_VERSION:
        return state  # sealed when it is next saved
    seal = StateSeal.beside(path)
    try:
        return _with_uploads(state, lambda upload: _opened_upload(upload, seal.open))
    except (InvalidToken, FileNotFoundError, ValueError) as exc:
        logger.warning(
            "the secrets in the Cloudflare emulator's state in %s cannot be opened with %s (%s); starting empty",
            path,
            seal.path,
            type(exc).__name__,
        )
        return None


def _with_uploads(state: AccountState, change: Callable[[ScriptUpload], ScriptUpload]) -> AccountState:
    """A copy of `state` with `change` made to every script's upload."""

    def changed(script: Script) -> Script:
        return replace(script, upload=change(script.upload))

    return AccountState(
        subdomain=state.subdomain,
        scripts={name: changed(script) for name, script in state.scripts.items()},
        namespaces={
            name: replace(namespace, scripts={n: changed(script) for n, script in namespace.scripts.items()})
            for name, namespace in state.namespaces.items()
        },
        kv_namespaces=state.kv_namespaces,
    )


def _sealed_upload(upload: ScriptUpload, seal: Callable[[str], str]) -> ScriptUpload:
    bindings = []
    for binding in upload.bindings:
        if binding.get("type") in SECRET_BINDING_TYPES:
            kept = {key: value for key, value in binding.items() if key not in ("name", "type")}
            binding = {"name": binding["name"], "type": binding["type"], _SEALED: seal(json.dumps(kept))}
        bindings.append(binding)
    texts = tuple(replace(text, value=seal(text.value)) if text.secret else text for text in upload.text_bindings)
    return replace(upload, bindings=bindings, text_bindings=texts)


def _opened_upload(upload: ScriptUpload, open_: Callable[[str], str]) -> ScriptUpload:
    bindings = []
    for binding in upload.bindings:
        if binding.get("type") in SECRET_BINDING_TYPES:
            binding = {"name": binding["name"], "type": binding["type"], **json.loads(open_(binding[_SEALED]))}
        bindings.append(binding)
    texts: tuple[TextBinding, ...] = tuple(
        replace(text, value=open_(text.value)) if text.secret else text for text in upload.text_bindings
    )
    return replace(upload, bindings=bindings, text_bindings=texts)
