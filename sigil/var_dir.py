"""SIGIL_VAR_DIR is owner-only: it holds the database and its journal, the key every derived
secret comes from, code bundles (with sealed secrets) and Redis's append-only file.

Sigil's processes run with the umask 077, so every directory they create is 0700 and every
file 0600, and so are those of the programs they start (redis-server, workerd), which
inherit it. Imports nothing of Sigil's: settings.py calls it first.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

UMASK = 0o077
#: in the var directory, what an older Sigil may have left readable by others
_SECRET_FILES = ("secret_key", "sigil.sqlite3", "sigil.sqlite3-wal", "sigil.sqlite3-shm", "sigil.sqlite3-journal")


def create_private() -> None:
    """Have this process (and what it starts) create owner-only files and directories."""
    os.umask(UMASK)


def private_directory(path: Path) -> Path:
    """Make `path` (and missing parents) owner-only, tightening one of ours left more open."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)
    return path


def tighten(var_dir: Path) -> None:
    """Make `var_dir` and the secrets an older Sigil created there readable by their owner only.

    Files and directories of another user, and a var directory that does not exist, are left alone."""
    var_dir = Path(var_dir)
    if not var_dir.is_dir():
        return
    _tighten(var_dir, 0o700)
    for name in _SECRET_FILES:
        _tighten(var_dir / name, 0o600)


def _tighten(path: Path, mode: int) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(mode)
