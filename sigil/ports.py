"""The ports Sigil's own processes listen on (127.0.0.1), from the web server's PORT alone.

workerd's first port (one per agent from there up) and the Cloudflare emulator's follow
from PORT: PORT + 788 and PORT + 787, so `make run` on 8000 uses 8788 and 8787. A port that
is taken by something else is replaced by a free one. `runsigil` records what it chose in
`SIGIL_VAR_DIR/ports.json`, and settings.py reads that file, so every command run on the
same var directory (`manage.py rollback`, `runworkerd`, a shell) agrees with the running
processes. SIGIL_WORKERD_PORT and CF_EMULATOR_PORT, when set, win and are never moved.

Two checkouts (each with its own var directory) thus run side by side with only PORT
set; PORTs at least SIGIL_MAX_AGENTS + 1 apart keep even their derived ports apart.

Standard library only: settings.py imports it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "ports.json"
WORKERD_OFFSET = 788
EMULATOR_OFFSET = 787
# Ports picked when the derived ones are taken: below the kernel's ephemeral range (from
# 32768), where outgoing connections take ports at any moment.
FREE_RANGE = (20_000, 32_768)


@dataclass(frozen=True)
class Ports:
    web: int
    workerd: int  # the first of `workerd_count`
    cfemulator: int


def recorded(var_dir: Path) -> dict[str, int]:
    """The ports last recorded for `var_dir`; {} when none were."""
    try:
        data = json.loads((Path(var_dir) / FILE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {name: port for name, port in data.items() if isinstance(port, int)}


def record(var_dir: Path, ports: Ports) -> None:
    """Write `ports` for every later command on `var_dir` (atomically: readers never see half)."""
    path = Path(var_dir) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(ports), sort_keys=True) + "\n")
    partial.replace(path)


def ports_choose(
    *,
    web: int,
    var_dir: Path,
    workerd_count: int,
    workerd_fixed: int | None = None,
    emulator_fixed: int | None = None,
) -> Ports:
    """The ports a Sigil serving on `web` uses: each fixed one as given, else the one derived
    from `web` when it is free, else the one recorded before when it is free, else a free one.
    `workerd_count` consecutive ports must be free for workerd (one per agent)."""
    before = recorded(var_dir)

    def pick(fixed: int | None, offset: int, name: str, count: int) -> int:
        if fixed is not None:
            return fixed
        for candidate in (web + offset, before.get(name)):
            if candidate is not None and _block_free(candidate, count, avoid={web}):
                return candidate
        return _free_block(count, avoid={web})

    workerd = pick(workerd_fixed, WORKERD_OFFSET, "workerd", workerd_count)
    workerd_ports = set(range(workerd, workerd + workerd_count))
    emulator = emulator_fixed
    if emulator is None:
        emulator = pick(None, EMULATOR_OFFSET, "cfemulator", 1)
        if emulator in workerd_ports:
            emulator = _free_block(1, avoid={web, *workerd_ports})
    return Ports(web=web, workerd=workerd, cfemulator=emulator)


def _block_free(first: int, count: int, *, avoid: set[int]) -> bool:
    ports = range(first, first + count)
    return ports[-1] <= 65_535 and first >= 1024 and not avoid & set(ports) and not any(map(port_is_open, ports))


def _free_block(count: int, *, avoid: set[int]) -> int:
    low, high = FREE_RANGE
    while True:
        first = random.randrange(low, high - count)
        if _block_free(first, count, avoid=avoid):
            return first


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on `host`:`port` now. A port in TIME_WAIT (one
    Sigil's own processes left a moment ago) is not open: it is still theirs to take."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def wait_for_port_closed(port: int, seconds: float) -> bool:
    """Whether nothing listens on 127.0.0.1:`port`, waiting up to `seconds` for it to be released."""
    deadline = time.monotonic() + seconds
    while port_is_open(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class HeldPort:
    """A port of 127.0.0.1 the kernel chose, held while this is open by a socket bound to it
    that never listens (with SO_REUSEADDR): the kernel gives it to no other bind to a free
    port nor to an outgoing connection meanwhile, while the server meant to listen there
    (workerd, which binds with SO_REUSEADDR too, as Linux allows beside a socket that does
    not listen) binds it, and binds it again after every restart. Nothing connects before
    that server listens. Two Sigils (two checkouts) thus never share such a port."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        """Let the port go (the server on it has stopped for good). Idempotent."""
        self._socket.close()


def free_port() -> int:
    """A port of 127.0.0.1 that is free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_block(count: int = 16) -> int:
    """The first of `count` consecutive ports of 127.0.0.1 that are free now, in FREE_RANGE:
    ports in the kernel's ephemeral range are handed out to outgoing connections at any
    moment, so a block of them picked now may be taken before use."""
    low, high = FREE_RANGE
    while True:
        base = random.randrange(low, high - count, count)
        if all(_can_bind(port) for port in range(base, base + count)):
            return base


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
