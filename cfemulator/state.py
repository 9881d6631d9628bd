"""The emulated account's state on disk, so it outlives the emulator's process as a
Cloudflare account outlives any client: scripts (with their uploads), dispatch namespaces,
KV namespaces and values, and the workers.dev subdomain.

It is one pickle, replaced atomically after each change and readable by the emulator's user
only (it holds secret_text values as uploaded, as the account's own store does). Settings,
counters and logs are not state: they come from the command line and start afresh.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfemulator.uploads import ScriptUpload
from sigil.files import write_atomically

logger = logging.getLogger(__name__)

# Raised when the shape of the state changes: a file of another version is not read.
# 2: text bindings are the emulator's own (cfemulator.uploads.TextBinding).
STATE_VERSION = 2


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
            "logpush": False,
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


def save_state(path: Path, state: AccountState) -> None:
    """Replace the state file with `state` (write_atomically's files are mode 0600)."""
    write_atomically(path, pickle.dumps((STATE_VERSION, state), protocol=pickle.HIGHEST_PROTOCOL))


def load_state(path: Path) -> AccountState | None:
    """The state saved at `path`, or None when there is none or it cannot be read (the
    account then starts empty, as after a reset; the reason is logged)."""
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
    if version != STATE_VERSION or not isinstance(state, AccountState):
        logger.warning("the Cloudflare emulator's state in %s is of another version; starting empty", path)
        return None
    return state
