"""The local runtime: capability code runs in workerd on this machine, through the loader host."""

from __future__ import annotations

import logging
from pathlib import Path

import urllib3

from capabilities.runtimes.base import (
    TEXT_BINDING_KINDS,
    CodeBundle,
    Route,
    Runtime,
    RuntimeRejected,
    RuntimeUnavailable,
)
from capabilities.runtimes.loader_host import loader_host_retire, loader_host_start_check
from capabilities.workerd import write_atomically

logger = logging.getLogger(__name__)


class LocalRuntime(Runtime):
    """Code is stored content-addressed (`{code_dir}/{sha}.json`) and read by the host.

    A placement is a small pointer file `{code_dir}/slots/{full name}` holding the sha, so
    that `list_slots` sees what is placed and `remove` knows which bundle may be freed.
    """

    name = "local"
    # workerd on this machine has no Cloudflare account behind it: only values can be given.
    binding_kinds = TEXT_BINDING_KINDS

    def __init__(
        self, *, code_dir: Path, workerd_url: str, secret: str, max_slots: int | None = None, safety_margin: int = 0
    ) -> None:
        self.max_slots = max_slots
        self.margin = safety_margin
        self.code_dir = Path(code_dir)
        self.slots_dir = self.code_dir / "slots"
        self.workerd_url = workerd_url.rstrip("/")
        self._secret = secret
        self._probe = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=2.0), retries=False)
        self._start_checks = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=30.0), retries=False)

    @property
    def total_slots(self) -> int | None:
        return self.max_slots

    @property
    def safety_margin(self) -> int:
        return self.margin

    def slot_for(self, full_name: str, *, attempt: int = 0) -> str:
        return full_name  # full names are unique, so they never collide

    def place(self, *, slot: str, bundle: CodeBundle) -> None:
        """Store the bundle (once per sha), have the host start it, and point the slot at it.
        Idempotent. Raises RuntimeRejected when the code does not start."""
        self.slots_dir.mkdir(parents=True, exist_ok=True)
        bundle_path = self.code_dir / f"{bundle.sha}.json"
        stored_now = not bundle_path.exists()
        if stored_now:
            write_atomically(bundle_path, bundle.to_json())
        try:
            if not loader_host_start_check(self._start_checks, self.route(slot=slot, sha=bundle.sha)):
                raise RuntimeUnavailable(f"workerd does not find the code just stored in {bundle_path}")
        except RuntimeRejected:
            if stored_now:
                bundle_path.unlink(missing_ok=True)
            raise
        pointer = self.slots_dir / slot
        previous = _pointed_sha(pointer)
        write_atomically(pointer, bundle.sha.encode())
        if previous not in (None, bundle.sha):
            self._drop_if_unused(previous)  # the replaced code (and any old secret it held)

    def remove(self, *, slot: str) -> None:
        """Drop the slot's pointer, its bundle when no other slot uses it, and its isolate in
        workerd. Idempotent."""
        pointer = self.slots_dir / slot
        sha = _pointed_sha(pointer)
        if sha is None:
            return
        pointer.unlink(missing_ok=True)
        self._drop_if_unused(sha)
        # The host retires a replaced version by itself, but a removed slot is never called
        # again: without this, its isolate would stay until workerd restarts.
        try:
            loader_host_retire(self._start_checks, self.route(slot=slot, sha=sha))
        except RuntimeUnavailable as exc:
            # The slot is gone all the same; a workerd that cannot be reached holds nothing
            # once it is restarted.
            logger.warning("workerd did not release %s@%s: %s", slot, sha, exc)

    def _drop_if_unused(self, sha: str) -> None:
        if not any(_pointed_sha(p) == sha for p in self.slots_dir.iterdir() if not p.name.startswith(".")):
            (self.code_dir / f"{sha}.json").unlink(missing_ok=True)

    def route(self, *, slot: str, sha: str, cpu_ms: int | None = None) -> Route:
        return Route(
            base_url=self.workerd_url,
            headers=(("X-Sigil-Secret", self._secret), ("X-Sigil-Loader-Id", f"{slot}@{sha}")),
        )

    def list_slots(self) -> list[str]:
        if not self.slots_dir.exists():
            return []
        return sorted(p.name for p in self.slots_dir.iterdir() if p.is_file() and not p.name.startswith("."))

    def check(self) -> None:
        """workerd answers a request without the secret with 403; anything else is a failure."""
        try:
            response = self._probe.request("GET", self.workerd_url + "/")
        except urllib3.exceptions.HTTPError as exc:
            raise RuntimeUnavailable(f"workerd is not reachable at {self.workerd_url}: {exc}") from exc
        if response.status != 403:
            raise RuntimeUnavailable(f"workerd at {self.workerd_url} answered {response.status}, expected 403")


def _pointed_sha(pointer: Path) -> str | None:
    try:
        return pointer.read_text().strip()
    except FileNotFoundError:
        return None
