"""pytest plugin loaded before pytest-django (`-p testsupport.environment` in pytest.ini):
chooses the services' addresses before Django's settings are read.

Every pytest-xdist worker gets its own var directory, its own embedded Redis (or its own
database number on REDIS_URL), and its own workerd port.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_worker_index = int(_worker[2:]) if _worker[2:].isdigit() else 0

_VAR_DIR = Path(tempfile.mkdtemp(prefix=f"sigil-test-{_worker}-"))
# Registered first so that it runs last, after the Redis server has stopped.
atexit.register(shutil.rmtree, _VAR_DIR, ignore_errors=True)
os.environ["SIGIL_VAR_DIR"] = str(_VAR_DIR)
os.environ.setdefault("SECRET_KEY", "sigil-test-suite-only")
# Server and worker threads close their connections after each request or task, so the
# test database can be dropped at the end of the session.
os.environ["SIGIL_DB_CONN_MAX_AGE"] = "0"

# The URL the suite was started with, kept aside before this module rewrites REDIS_URL, so
# that xdist workers (which inherit the rewritten environment) decide the same way.
os.environ.setdefault("SIGIL_TEST_REDIS_BASE", os.environ.get("REDIS_URL", ""))

if os.environ["SIGIL_TEST_REDIS_BASE"]:
    # A shared server (CI): one database number per xdist worker, so flushes stay private.
    _base = os.environ["SIGIL_TEST_REDIS_BASE"].rstrip("/")
    _base = _base.rsplit("/", 1)[0] if _base.count("/") > 2 else _base
    os.environ["REDIS_URL"] = f"{_base}/{1 + _worker_index}"
else:
    from sigil.embedded_redis import EmbeddedRedis

    # Nothing to keep across a run that starts from an empty directory each time.
    _embedded_redis = EmbeddedRedis(_VAR_DIR / "redis", durable=False)
    _embedded_redis.start()
    atexit.register(_embedded_redis.stop)
    os.environ["REDIS_URL"] = _embedded_redis.url

from sigil.ports import free_port_block  # noqa: E402

os.environ["SIGIL_WORKERD_PORT"] = str(free_port_block())
