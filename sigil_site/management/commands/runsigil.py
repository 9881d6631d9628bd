"""Run all of Sigil on this machine (what `make run` does after `migrate`)."""

from __future__ import annotations

import http.client
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from kombu.exceptions import OperationalError as KombuOperationalError

from capabilities.runtimes import runtime_class
from capabilities.runtimes.base import Process
from capabilities.runtimes.cloudflare.account import runs_on_local_emulator
from capabilities.services import runtimes_still_holding
from sigil import ports as sigil_ports
from sigil.embedded_redis import EmbeddedRedis
from sigil.lifetime import PidFiles, supervise_until_signalled
from sigil.logs import SigilFormatter
from sigil.ports import port_is_open
from sigil.serving import RUNSIGIL, Serving, serving_forget, serving_record, switch_command
from sigil_site.owner import OwnerAccount, owner_ensure_shown
from sigil_site.stand_in import STAND_IN_HEADER, StandIn
from sigil_site.supervisor import Program, StartupFailed, Supervisor

MANAGE = str(settings.BASE_DIR / "manage.py")
# granian's own lines in Sigil's log format (read by its master process, without Django).
GRANIAN_LOGGING = settings.BASE_DIR / "sigil_site" / "granian-logging.json"


class Command(BaseCommand):
    help = (
        "Run Sigil: the bundled Redis (when REDIS_URL is unset), workerd, a Celery worker with beat "
        "and the web server (granian) on 127.0.0.1:PORT; restart any that dies; stop them all on Ctrl-C or SIGTERM."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8000, help="Port of the web server (default 8000).")
        parser.add_argument(
            "--ready-timeout", type=float, default=60.0, help="Seconds to wait for everything to answer."
        )
        parser.add_argument(
            "--dev",
            action="store_true",
            help="serve with uvicorn, which restarts when the code changes (make dev), instead of granian",
        )
        parser.add_argument("--migrate", action="store_true", help="apply the database's migrations first (make run)")

    def handle(
        self, *args, port: int, ready_timeout: float, dev: bool = False, migrate: bool = False, **options
    ) -> None:
        pid_files = PidFiles(settings.VAR_DIR / "run")
        self._end_leftovers(pid_files)
        self._check_not_running(port)
        # From here until the web server binds the port, callers are told to come back.
        stand_in = StandIn(port)
        stand_in.open()
        try:
            self._run(pid_files, port=port, ready_timeout=ready_timeout, dev=dev, migrate=migrate, stand_in=stand_in)
        finally:
            stand_in.close()

    def _run(
        self, pid_files: PidFiles, *, port: int, ready_timeout: float, dev: bool, migrate: bool, stand_in: StandIn
    ) -> None:
        settle_ports(port)  # only now: a Sigil already running on this var directory keeps its ports
        if migrate:
            self._migrate()
        backends = runtimes_served()
        self._check_can_start(backends)
        base_url = f"http://127.0.0.1:{port}"
        if not dev:
            # granian serves the admin's files from STATIC_ROOT, as a proxy would in production.
            call_command("collectstatic", interactive=False, verbosity=0)

        programs, redis_url = sigil_programs(port=port, backends=backends, dev=dev, stand_in=stand_in)
        self._say(
            f"Sigil: backend  {describe_backend()}\n"
            + "".join(f"       also     {line}\n" for line in describe_previous(backends[1:]))
            + f"       database {describe_database()}\n"
            f"       redis    {describe_redis(redis_url)}"
        )
        supervisor = Supervisor(programs, emit=self._write, log_format=settings.SIGIL_LOG_FORMAT, pid_files=pid_files)

        def on_ready() -> None:
            # Only now, so that a password generated for the owner is not lost in a failed start.
            owner = owner_ensure_shown(password=settings.SIGIL_OWNER_PASSWORD, var_dir=settings.VAR_DIR)
            connections.close_all()
            supervisor.announce(self._as_log(banner(base_url, owner)))

        def supervise(stop: threading.Event) -> None:
            supervisor.run(stop, on_ready=on_ready, ready_timeout=ready_timeout)

        pid_files.record(RUNSIGIL, os.getpid())
        # For commands run from another shell, without this one's SIGIL_BACKEND (switchbackend).
        serving_record(settings.VAR_DIR, Serving(backend=settings.SIGIL_BACKEND, port=port, pid=os.getpid()))
        try:
            supervise_until_signalled(supervise, name="supervisor")
        except StartupFailed as exc:
            raise CommandError(f"{exc}: Sigil did not start (its last output is above)") from exc
        finally:
            serving_forget(settings.VAR_DIR)
            pid_files.forget(RUNSIGIL)
        self._say("Sigil stopped.")

    def _end_leftovers(self, pid_files: PidFiles) -> None:
        """End what a run on this var directory that was killed left behind (its programs
        got SIGTERM when it died; one that did not stop holds its ports), before binding them."""
        running = pid_files.running(RUNSIGIL)
        if running is not None and running != os.getpid():
            raise CommandError(f"Sigil already runs on {settings.VAR_DIR} (pid {running}): stop it first")
        pid_files.forget(RUNSIGIL)
        ended = pid_files.end_leftovers()
        if ended:
            self._say(f"Sigil: ended what a previous run left running: {', '.join(ended)}")

    def _say(self, text: str) -> None:
        self._write(self._as_log(text))

    def _as_log(self, text: str) -> str:
        """What runsigil says itself: as it is on a terminal, one record in a JSON log."""
        if settings.SIGIL_LOG_FORMAT != "json":
            return text
        record = logging.LogRecord(__name__, logging.INFO, __file__, 0, text.strip("\n"), None, None)
        return SigilFormatter(kind="json").format(record)

    def _write(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _check_not_running(self, port: int) -> None:
        if port_is_open(port):
            raise CommandError(f"port {port} is in use: stop what holds it, or choose another (make run PORT=...)")
        if settings.SIGIL_EMBEDDED_REDIS and embedded_redis().ping():
            raise CommandError(f"a Redis server already answers on {settings.REDIS_URL}: is Sigil running already?")

    def _migrate(self) -> None:
        """Apply the database's migrations, in this process: one Django start less than a
        `manage.py migrate` before it, while the stand-in answers."""
        if unapplied_migrations():
            call_command("migrate", interactive=False, verbosity=0)
            self._say("Sigil: applied the database's migrations")
        connections.close_all()

    def _check_can_start(self, backends: list[str]) -> None:
        if unapplied_migrations():
            raise CommandError("the database has unapplied migrations: run `python manage.py migrate` first")
        processes = runtime_processes(backends)
        for process in processes:
            if port_is_open(process.port):
                raise CommandError(
                    f"{process.port_name} {process.port} is in use: stop what holds it, or {process.port_hint}"
                )
        if processes and not Path(settings.SIGIL_WORKERD_BIN).exists():  # each runs workerd
            raise CommandError(f"workerd not found at {settings.SIGIL_WORKERD_BIN}: run `make install`")
        connections.close_all()


def unapplied_migrations() -> bool:
    connection = connections[DEFAULT_DB_ALIAS]
    executor = MigrationExecutor(connection)
    return bool(executor.migration_plan(executor.loader.graph.leaf_nodes()))


# Set in the environment of a runsigil that started itself afresh to read the ports it chose.
PORTS_SETTLED = "SIGIL_RUNSIGIL_PORTS_SETTLED"


def settle_ports(web: int) -> None:
    """Choose workerd's and the emulator's ports from `web` (sigil/ports.py) and record
    them under VAR_DIR, where every process and command reads them with its settings. This
    process read its settings before: when they differ, it starts again (exec, same pid)
    to read the recorded ones, as its children will. Ports set in the environment stay."""
    # Set in the environment, not by default (settings cannot tell these apart).
    workerd_fixed = settings.SIGIL_WORKERD_PORT if os.environ.get("SIGIL_WORKERD_PORT") else None
    # CF_API_BASE set to an emulator on this machine names its port too.
    emulator_set = os.environ.get("CF_EMULATOR_PORT") or (
        runs_on_local_emulator(settings) and not settings.SIGIL_CF_EMULATED
    )
    chosen = sigil_ports.ports_choose(
        web=web,
        var_dir=settings.VAR_DIR,
        workerd_count=settings.SIGIL_MAX_AGENTS,
        workerd_fixed=workerd_fixed,
        emulator_fixed=settings.CF_EMULATOR_PORT if emulator_set else None,
    )
    sigil_ports.record(settings.VAR_DIR, chosen)
    if (chosen.workerd, chosen.cfemulator) == (settings.SIGIL_WORKERD_PORT, settings.CF_EMULATOR_PORT):
        return
    if os.environ.get(PORTS_SETTLED):
        raise CommandError(f"the ports chosen changed again while Sigil started ({chosen}): start it again")
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, PORTS_SETTLED: "1"})


def embedded_redis() -> EmbeddedRedis:
    """The bundled Redis, on the socket the settings default to when REDIS_URL is unset."""
    return EmbeddedRedis(settings.VAR_DIR / "redis", socket_path=Path(urlsplit(settings.REDIS_URL).path))


def runtimes_served() -> list[str]:
    """The runtimes this start serves from: SIGIL_BACKEND's, then each runtime a switch has
    not moved every capability from yet (they are served there until switchbackend has
    moved them, so their processes run too; they stay until the next start)."""
    return [settings.SIGIL_BACKEND, *runtimes_still_holding(settings.SIGIL_BACKEND)]


def runtime_processes(backends: list[str]) -> list[Process]:
    """What the runtimes `backends` need on this machine (workerd, the emulator), each once.
    A runtime Sigil no longer knows is skipped: /_health says what is left on it."""
    processes: dict[str, Process] = {}
    for backend in backends:
        try:
            needed = runtime_class(backend).processes(settings)
        except ValueError:
            continue
        for process in needed:
            processes.setdefault(process.command, process)
    return list(processes.values())


def sigil_programs(
    *, port: int, backends: list[str], dev: bool = False, stand_in: StandIn | None = None
) -> tuple[list[Program], str]:
    """What runsigil runs, in the order it starts them, and the Redis URL they are given.

    The runtimes' processes start together and are ready before the web server starts, so
    that its first calls find them; the web server answers before the Celery worker starts,
    and on Ctrl-C (which stops them in the reverse order) it answers calls while the worker
    finishes its tasks. Until the web server answers, and once it has stopped, `stand_in`
    holds its port (beside granian while granian starts: both set SO_REUSEPORT).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    programs = []
    if settings.SIGIL_EMBEDDED_REDIS:
        redis = embedded_redis()
        redis.prepare()
        # The children would find the socket at the same default path; passing it makes
        # that explicit and independent of their settings.
        env["REDIS_URL"] = redis.url
        programs.append(Program("redis", redis.command(), ready=redis.ping, needed_by_others=True))
    processes = runtime_processes(backends)
    for process in processes:
        ready = process.ready or (lambda port=process.port: port_is_open(port))
        command = [sys.executable, MANAGE, process.command]
        # Started together; the web server after they are all ready.
        needed = process is processes[-1]
        programs.append(
            Program(process.name, command, ready=ready, env=named(env, process.name), needed_by_others=needed)
        )
    web = runserver_command(port) if dev else granian_command(port)
    # The Celery worker starts once the web server answers, whose start it would slow down.
    programs.append(
        Program(
            "web",
            web,
            ready=lambda: http_answers(port),
            env=named(env, "web"),
            stand_in=stand_in,
            reuses_port=not dev,
            needed_by_others=True,
        )
    )
    node = f"sigil-{os.getpid()}@{socket.gethostname()}"
    celery = [
        # --quiet: no banner; Celery logs through Sigil's configuration (sigil_site/celery.py).
        sys.executable, "-m", "celery", "--quiet", "-A", "sigil_site", "worker", "--beat",
        "--concurrency", "2", "--loglevel", "INFO", "--hostname", node,
        # Every queue: the default one and the deploys' (on the Cloudflare runtimes a deploy
        # request waits for its placement there).
        "--queues", f"celery,{settings.SIGIL_DEPLOY_QUEUE}",
        # One worker alone: asking for neighbours only delays its start by a second.
        "--without-mingle", "--without-gossip",
        "--schedule", str(settings.CELERY_BEAT_SCHEDULE_FILENAME),
    ]  # fmt: skip
    programs.append(
        Program("celery", celery, ready=lambda: celery_answers(node), env=named(env, "celery"), stop_timeout=20.0)
    )
    return programs, env.get("REDIS_URL", settings.REDIS_URL)


def named(env: dict[str, str], name: str) -> dict[str, str]:
    """`env` for the program `name`, whose log lines carry that name."""
    return {**env, "SIGIL_PROCESS_NAME": name}


def granian_command(port: int) -> list[str]:
    """The server docs/operations.md's Production section runs, with one worker: ASGI on uvloop, so
    that calls in flight wait on events, not threads. The backpressure (requests in flight
    per worker) is far above what the agents' shares add up to by default."""
    return [
        str(Path(sys.executable).parent / "granian"),
        "--interface", "asgi", "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--http", "1", "--backlog", "4096", "--backpressure", "8192",
        "--respawn-failed-workers", "--log-config", str(GRANIAN_LOGGING),
        "--static-path-route", "/static", "--static-path-mount", str(settings.STATIC_ROOT),
        "sigil_site.asgi:application",
    ]  # fmt: skip


def runserver_command(port: int) -> list[str]:
    """uvicorn, restarting when the code changes; the admin's static files served by Django's
    handler (sigil_site.asgi.development_application)."""
    return [
        str(Path(sys.executable).parent / "uvicorn"),
        "sigil_site.asgi:development_application", "--factory", "--reload", "--reload-dir", str(settings.BASE_DIR),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip


def banner(base_url: str, owner: OwnerAccount) -> str:
    if owner.generated_password:
        login = f"user {owner.username}, password {owner.generated_password}, shown until you sign in"
    elif owner.created:
        login = f"user {owner.username}, password from SIGIL_OWNER_PASSWORD"
    else:
        login = f"user {owner.username}; new password: python manage.py changepassword {owner.username}"
    return f"""
Sigil is running at {base_url}/
  Admin      {base_url}/admin/   ({login})
  API docs   {base_url}/_api/schema/docs
  New agent  .venv/bin/python manage.py createagent NAME --json
  Calls      {base_url}/{{agent}}/{{capability}} with the agent's invoke token
Press Ctrl-C to stop.
"""


def describe_backend() -> str:
    return ", ".join([settings.SIGIL_BACKEND, *runtime_class(settings.SIGIL_BACKEND).where(settings)])


def describe_previous(backends: list[str]) -> list[str]:
    """A line for each runtime other than SIGIL_BACKEND's served until a switch empties it."""
    lines = []
    for backend in backends:
        try:
            where = runtime_class(backend).where(settings)
        except ValueError:
            where = ["a runtime Sigil no longer knows"]
        until = f"until `{switch_command(settings.SIGIL_BACKEND)}` has moved its capabilities"
        lines.append(", ".join([backend, *where]) + f", {until}")
    return lines


def describe_database() -> str:
    db = settings.DATABASES[DEFAULT_DB_ALIAS]
    vendor = connections[DEFAULT_DB_ALIAS].vendor
    if vendor == "sqlite":
        return f"SQLite {db['NAME']}"
    where = f"{db.get('HOST') or 'local socket'}{':' + str(db['PORT']) if db.get('PORT') else ''}"
    return f"{vendor} database {db['NAME']} on {where}"


def describe_redis(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        url = urlunsplit(parts._replace(netloc=netloc))
    return f"bundled redis-server on {url}" if settings.SIGIL_EMBEDDED_REDIS else url


def celery_answers(node: str) -> bool:
    from sigil_site.celery import app

    try:
        return bool(app.control.ping(destination=[node], timeout=0.5))
    except (OSError, KombuOperationalError, redis.RedisError):
        return False


def http_answers(port: int) -> bool:
    """Whether the web server answers on `port` (not the stand-in beside it)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/admin/login/")
        response = connection.getresponse()
        response.read()
        return response.getheader(STAND_IN_HEADER) is None
    except OSError:
        return False
    finally:
        connection.close()
