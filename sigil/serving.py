"""What the Sigil running on a var directory serves, for commands started from another shell.

`runsigil` records its runtime (SIGIL_BACKEND) and web port in `SIGIL_VAR_DIR/run/serving.json`
while it runs, beside its pid file, and removes it when it stops. A command run from a shell
that did not set SIGIL_BACKEND (`switchbackend`) reads it to act on the runtime that Sigil
serves, not on the settings' default.

Standard library only, but for Sigil's own pid files.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from sigil.lifetime import PidFiles

FILE_NAME = "serving.json"
#: the name of runsigil's pid file under the same directory
RUNSIGIL = "runsigil"


@dataclass(frozen=True)
class Serving:
    """The running Sigil's runtime, the port its web server answers on, and its supervisor's pid."""

    backend: str
    port: int
    pid: int


def _path(var_dir: Path) -> Path:
    return Path(var_dir) / "run" / FILE_NAME


def serving_record(var_dir: Path, serving: Serving) -> None:
    """Record what the Sigil starting now serves (atomically: readers never see half)."""
    path = _path(var_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(serving), sort_keys=True) + "\n")
    partial.replace(path)


def serving_forget(var_dir: Path) -> None:
    """The Sigil that recorded it stopped. Idempotent."""
    _path(var_dir).unlink(missing_ok=True)


def serving_now(var_dir: Path) -> Serving | None:
    """What the Sigil running on `var_dir` serves; None when none runs there (or one that
    was killed left its record behind) or it recorded nothing."""
    try:
        data = json.loads(_path(var_dir).read_text())
        serving = Serving(backend=str(data["backend"]), port=int(data["port"]), pid=int(data["pid"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    if PidFiles(Path(var_dir) / "run").running(RUNSIGIL) != serving.pid:
        return None
    return serving


def switch_command(backend: str) -> str:
    """The command that moves every capability to `backend`, exactly as the owner types it in
    any shell: naming the runtime, so it does not depend on that shell's environment."""
    return f"SIGIL_BACKEND={backend} python manage.py switchbackend"
