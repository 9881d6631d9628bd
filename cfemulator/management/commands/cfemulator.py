"""`manage.py cfemulator`: serve the local Cloudflare API emulator on 127.0.0.1 until stopped."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from types import FrameType

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from capabilities.workerd.host import WorkerdMissing
from cfemulator.api import DEV_ACCOUNT_ID, DEV_TOKEN, PLANS, EmulatorConfig, parse_rate_limit
from cfemulator.server import EmulatorServer
from sigil.ports import free_port


class Command(BaseCommand):
    help = (
        "Serve the subset of the Cloudflare REST API that Sigil uses on 127.0.0.1, with Cloudflare's "
        "envelopes, error codes, script quota and rate limit; uploaded scripts run on workerd."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = EmulatorConfig()
        parser.add_argument("--port", type=int, default=settings.CF_EMULATOR_PORT, help="port on 127.0.0.1")
        parser.add_argument("--script-limit", type=int, default=defaults.script_limit, help="Workers per account")
        parser.add_argument("--latency", type=float, default=defaults.latency, help="seconds added to each API call")
        parser.add_argument(
            "--rate-limit", default=f"{defaults.rate_limit}/{defaults.rate_window:g}", help="REQUESTS/SECONDS"
        )
        parser.add_argument("--fault-rate", type=float, default=defaults.fault_rate, help="fraction of calls that 5xx")
        parser.add_argument(
            "--script-max-bytes", type=int, default=defaults.script_max_bytes, help="compressed script size limit"
        )
        parser.add_argument("--subdomain", default=defaults.subdomain, help="the account's workers.dev subdomain")
        parser.add_argument(
            "--default-cpu-ms",
            type=int,
            default=defaults.default_cpu_ms,
            help="CPU ms a call may use when its script sets no limit (Paid plan: 30000, Free: 10)",
        )
        parser.add_argument(
            "--plan",
            choices=sorted(PLANS),
            default=defaults.plan,
            help="the account's plan (free refuses worker_loader)",
        )
        parser.add_argument(
            "--workers-for-platforms",
            action=argparse.BooleanOptionalAction,
            default=defaults.workers_for_platforms,
            help="whether the account subscribes to Workers for Platforms (dispatch namespaces)",
        )
        parser.add_argument(
            "--propagation-delay",
            type=float,
            default=defaults.propagation_delay,
            help="seconds before new scripts, workers.dev toggles and KV writes reach the Workers runtime",
        )
        parser.add_argument(
            "--token", default=settings.CF_API_TOKEN or DEV_TOKEN, help="the API token accepted (default CF_API_TOKEN)"
        )
        parser.add_argument(
            "--account-id",
            default=settings.CF_ACCOUNT_ID or DEV_ACCOUNT_ID,
            help="the account id (default CF_ACCOUNT_ID)",
        )
        parser.add_argument(
            "--workerd-port", type=int, default=0, help="port of the emulator's workerd (default: free)"
        )
        parser.add_argument("--state-dir", default=str(settings.VAR_DIR / "cfemulator"), help="code and workerd files")

    def handle(self, *args, **options) -> None:
        try:
            limit, window = parse_rate_limit(options["rate_limit"])
            config = EmulatorConfig().updated(
                {
                    "script_limit": options["script_limit"],
                    "latency": options["latency"],
                    "fault_rate": options["fault_rate"],
                    "script_max_bytes": options["script_max_bytes"],
                    "subdomain": options["subdomain"],
                    "default_cpu_ms": options["default_cpu_ms"],
                    "propagation_delay": options["propagation_delay"],
                    "rate_limit": f"{limit}/{window:g}",
                    "plan": options["plan"],
                    "workers_for_platforms": options["workers_for_platforms"],
                }
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        server = EmulatorServer.build(
            workerd_binary=settings.SIGIL_WORKERD_BIN,
            state_dir=Path(options["state_dir"]),
            token=options["token"],
            account_id=options["account_id"],
            config=config,
            port=options["port"],
            workerd_port=options["workerd_port"] or free_port(),
        )
        try:
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


def _exit(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
