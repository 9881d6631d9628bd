# Sigil's entry points. Only python3 and node/npm are assumed on the machine; everything
# else (the virtualenv, Python packages, workerd, and Chromium for the tests) is installed
# here, and only when the files that pin it have changed since the last install.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# pytest-xdist workers; each gets its own Redis, workerd and database.
TEST_WORKERS ?= 2

# The stamps are touched after a successful install, so an interrupted one runs again.
PY_STAMP := $(VENV)/.sigil-requirements
NODE_STAMP := node_modules/.sigil-package-lock
# The admin's browser tests drive Debian's Chromium through Playwright (never a browser
# that Playwright downloads itself).
CHROMIUM := /usr/bin/chromium

.PHONY: install run dev test lint format bench

install: $(PY_STAMP) $(NODE_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(PY_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# npm ci starts from an empty node_modules, which also drops the old stamp.
$(NODE_STAMP): package.json package-lock.json .npmrc
	npm ci --no-audit --no-fund
	touch $@

# Installed as root (CI runs as root); elsewhere, install the chromium package by hand.
$(CHROMIUM):
	@if [ "$$(id -u)" != 0 ]; then echo "$(CHROMIUM) is missing: run 'sudo apt-get install -y chromium'"; exit 1; fi
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The warm-call benchmark's load generator (bench/invoke.py), installed as Chromium is.
WRK := /usr/bin/wrk
$(WRK):
	@if [ "$$(id -u)" != 0 ]; then echo "$(WRK) is missing: run 'sudo apt-get install -y wrk'"; exit 1; fi
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk

# runsigil applies the migrations itself and creates the owner's account once everything
# answers (as `manage.py migrate` and `manage.py ensureowner` do in production): two Django
# starts fewer before the web port answers.
run: install
	exec $(PY) manage.py runsigil --migrate --port $(PORT)

# The same, with uvicorn restarting the web process when the code changes.
dev: install
	exec $(PY) manage.py runsigil --migrate --dev --port $(PORT)

test: lint $(CHROMIUM)
	$(PY) -m pytest -n $(TEST_WORKERS)

# Style, and the layering (the import contracts in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The figures in docs/benchmarks.md: warm-call overhead and throughput over plain workerd and
# the loader host (with wrk), the engine's HTTP and Redis clients, one agent's storm beside
# another, paging costs, the runtimes side by side, workerd's memory, what each process's death
# costs, what a switch of runtimes costs the callers, what ordinary traffic costs of
# Cloudflare's API budget (10 minutes of it on each Cloudflare runtime, side by side), and the
# edge against the straight dispatch and the origin, with ten minutes of its traffic before a
# deploy and a page-in.
bench: install $(WRK)
	$(PY) bench/invoke.py
	$(PY) bench/upstream_clients.py
	$(PY) bench/redis_clients.py
	$(PY) bench/storm.py
	$(PY) bench/pagein.py
	$(PY) bench/pager.py
	$(PY) bench/runtimes.py
	$(PY) bench/mcp.py
	$(PY) bench/mcp_sdk.py
	$(PY) bench/cost_replay.py
	$(PY) bench/emulator_limits.py
	$(PY) bench/workerd_memory.py
	$(PY) bench/faults.py
	$(PY) bench/runtime_switch.py
	$(PY) bench/api_budget.py
	$(PY) bench/edge.py
	$(PY) bench/edge_budget.py
