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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capabilities.workerd import write_atomically

logger = logging.getLogger(__name__)

# Raised when the shape of the state changes: a file of another version is not read.
STATE_VERSION = 1


@dataclass
class AccountState:
    subdomain: str
    scripts: dict[str, Any]  # name -> cfemulator.api.Script
    namespaces: dict[str, Any]  # name -> cfemulator.api.DispatchNamespace
    kv_namespaces: dict[str, Any]  # id -> cfemulator.api.KvNamespace


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
