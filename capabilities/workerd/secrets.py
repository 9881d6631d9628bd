"""The secret values of the code the local runtime's workerd runs, to mask what it prints.

A capability's `console.log(env.APIKEY)`, or an uncaught error naming it, is printed by
workerd on its output, which Sigil copies into workerd's per-process log file and its own
log (capabilities.workerd.host). Every value a capability may hold in `env` as a secret is in
a bundle of the code store (`{code_dir}/{sha}.json`), sealed for the host: the supervisor,
which holds the host's secret, opens each new bundle once and replaces each value with
`[secret NAME]` in every line before anything is written. A bundle is stored before any
code of it runs, so a line that names a value always finds it known.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from capabilities.sealing import bundle_secrets_unseal

logger = logging.getLogger(__name__)

_SETTLED_NS = 2_000_000_000


class StoredSecrets:
    """The secret values of every bundle seen in `code_dir`, kept for the life of the process
    (a line may name a bundle's value after the bundle was removed)."""

    def __init__(self, *, code_dir: Path, seal_key: str) -> None:
        self.code_dir = Path(code_dir)
        self.seal_key = seal_key
        self._seen: set[str] = set()
        self._pairs: list[tuple[str, str]] = []
        self._stamp: int | None = None
        self._lock = threading.Lock()

    def mask(self, text: str) -> str:
        """`text` with every known secret value replaced by `[secret NAME]`, the longest first.
        Looks for new bundles when the code store changed since the last look (one stat)."""
        self._refresh()
        for name, value in self._pairs:
            if value in text:
                text = text.replace(value, f"[secret {name}]")
        return text

    def _refresh(self) -> None:
        try:
            stamp = self.code_dir.stat().st_mtime_ns
        except OSError:
            return
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            complete = True
            pairs = set(self._pairs)
            for path in self.code_dir.glob("*.json"):
                sha = path.stem
                if sha in self._seen:
                    continue
                try:
                    secrets = bundle_secrets_unseal(path.read_bytes(), seal_key=self.seal_key, sha=sha)
                except OSError:
                    complete = False  # removed meanwhile, or not readable now: looked at again
                    continue
                except ValueError as exc:
                    # Sealed for an earlier host secret (the host cannot open it either), or no
                    # bundle at all: nothing of it can run.
                    logger.debug("bundle %s not opened to mask its secrets: %s", sha, exc)
                    secrets = {}
                self._seen.add(sha)
                pairs.update((name, value) for name, value in secrets.items() if value)
            self._pairs = sorted(pairs, key=lambda pair: -len(pair[1]))
            # A directory's time moves in the kernel's coarse ticks: a bundle stored in the
            # same tick as the last look leaves it unchanged, so a recent one is looked at again.
            settled = time.time_ns() - stamp > _SETTLED_NS
            self._stamp = stamp if complete and settled else None
