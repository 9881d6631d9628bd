"""`manage.py cfemulator`: serve the local Cloudflare API emulator on 127.0.0.1 until stopped."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from capabilities.workerd.host import WorkerdMissing
from cfemulator.config import DEV_ACCOUNT_ID, DEV_TOKEN, PLANS, EmulatorConfig
from cfemulator.server import EmulatorServer
from sigil.ports import HeldPort

# The account's settings the command line gives (their defaults are EmulatorConfig's), with
# what argparse needs to read each.
_SETTINGS: dict[str, dict[str, Any]] = {
    "script_limit": {"type": int, "help": "Workers per account"},
    "latency": {"type": float, "help": "seconds added to each API call"},
    "rate_limit": {"help": "REQUESTS/SECONDS"},
    "fault_rate": {"type": float, "help": "fraction of calls that 5xx"},
    "script_max_bytes": {"type": int, "help": "compressed script size limit"},
    "subdomain": {"help": "the account's workers.dev subdomain"},
    "default_cpu_ms": {
        "type": int,
        "help": "CPU ms a call may use when its script sets no limit (Paid plan: 30000, Free: 10)",
    },
    "plan": {"choices": sorted(PLANS), "help": "the account's plan (free refuses worker_loader)"},
    "workers_for_platforms": {
        "action": argparse.BooleanOptionalAction,
        "help": "whether the account subscribes to Workers for Platforms (dispatch namespaces)",
    },
    "propagation_delay": {
        "type": float,
        "help": "seconds before new scripts and workers.dev toggles reach the Workers runtime",
    },
    "kv_propagation_seconds": {
        "type": float,
        "help": "seconds before a KV write reaches the Workers runtime's other locations (Cloudflare: up to 60)",
    },
}


class Command(BaseCommand):
    help = (
        "Serve the subset of the Cloudflare REST API that Sigil uses on 127.0.0.1, with Cloudflare's "
        "envelopes, error codes, script quota and rate limit; uploaded scripts run on workerd."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = EmulatorConfig().to_json()
        for name, options in _SETTINGS.items():
            parser.add_argument(f"--{name.replace('_', '-')}", default=defaults[name], **options)
        parser.add_argument("--port", type=int, default=settings.CF_EMULATOR_PORT, help="port on 127.0.0.1")
        parser.add_argument(
            "--token", default=settings.CF_API_TOKEN or DEV_TOKEN, help="the API token accepted (default CF_API_TOKEN)"
        )
        parser.add_argument(
            "--account-id",
            default=settings.CF_ACCOUNT_ID or DEV_ACCOUNT_ID,
            help="the account id (default CF_ACCOUNT_ID)",
        )
        parser.add_argument(
            "--workerd-port",
            type=int,
            default=0,
            help="port of the emulator's workerd (default: one the kernel chooses, held while the emulator runs)",
        )
        parser.add_argument("--state-dir", default=str(settings.VAR_DIR / "cfemulator"), help="code and workerd files")

    def handle(self, *args, **options) -> None:
        try:
            config = EmulatorConfig().updated({name: options[name] for name in _SETTINGS})
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        # Chosen by the kernel and held while the emulator runs: another checkout never takes it.
        held = HeldPort()
        server = EmulatorServer.build(
            workerd_binary=settings.SIGIL_WORKERD_BIN,
            state_dir=Path(options["state_dir"]),
            token=options["token"],
            account_id=options["account_id"],
            config=config,
            port=options["port"],
            workerd_port=options["workerd_port"] or held.port,
        )
        try:
            # Started here, so that a missing binary is the command's error; the supervisor
            # then watches this very process and starts another only once it has died.
            server.workerd.start()
        except WorkerdMissing as exc:
            raise CommandError(str(exc)) from exc
        stop = threading.Event()
        supervisor = threading.Thread(target=server.workerd.supervise, args=(stop,), name="workerd", daemon=True)
        supervisor.start()
        # SIGTERM ends serve_forever like Ctrl-C does, so workerd is always stopped with us.
        signal.signal(signal.SIGTERM, _exit)
        try:
            try:
                server.bind()
            except OSError as exc:
                raise CommandError(f"cannot listen on 127.0.0.1:{options['port']}: {exc}") from exc
            self.stdout.write(
                f"Cloudflare emulator: API {server.api_base} (account {options['account_id']}), "
                f"workers.dev *.{config.subdomain}.workers.dev via Host header, workerd on port {server.workerd.port}"
            )
            self.stdout.flush()
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            supervisor.join(timeout=10)
            server.stop()
            held.close()


def _exit(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
