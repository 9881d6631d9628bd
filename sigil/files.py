"""Files that other processes read at any moment (code bundles, status, kill records, the
emulator's state), replaced in one step so that no reader ever sees half of one.

Imports nothing of Sigil's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one step (the file is owner-only, as mkstemp makes it):
    workerd may read a code bundle (or a slot's pointer) at any moment, and must never see a
    half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
