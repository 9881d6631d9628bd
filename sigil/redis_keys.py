"""Every Redis key Sigil writes, named once: its family, what it holds, who writes it, and when
it expires. No other module spells a key (sigil/tests/test_redis_keys.py checks it); they name
one through this module, and the keys' spelling here is the data already in Redis, so a name
is never changed without moving what its key holds.

A family with one key per thing is a function of that thing (`route("alice--ping")` is
`sigil:route:alice--ping`); a key of its own is a constant. Full names (`agent--name`) hold
`--`, so no capability's key in a family can be one of the family's own keys (`sigil:stats:dirty`).

Families, and the module that owns each one's values (the writer named at each key below):

| family | what it keeps | owner |
|---|---|---|
| tokens | each token's authority, last use, failed authentications | agents/tokens.py, agents/throttle.py |
| copies | each capability's route and contract, read on every call | capabilities/books/copies.py |
| stats | what calls leave before the flush moves it to the database | capabilities/books/stats.py |
| breaker | each capability's breaker, and its recent failures | capabilities/books/breaker.py, failures.py |
| logs | each call's record, the bounds and losses around them | capabilities/books/call_logs.py |
| degraded cache | the last good answers served while a breaker is open | capabilities/books/degraded_cache.py |
| pager | which capabilities are placed, placing, evicting, in flight | capabilities/books/pager.py |
| deploys | cool-downs, locks, outcomes of deploys and placements | capabilities/services/ |
| async calls | the queue, each call's record, runners | capabilities/services/async_calls.py |
| edge | what to publish to Workers KV, the edge's reports | sigil/edge_state.py, capabilities/services/edge*.py |
| cloudflare | the API's counters, rate budget and account facts | capabilities/runtimes/cloudflare/ |
| processes | liveness, beat's leader and last runs, MCP sessions, caches | sigil/, sigil_site/, capabilities/ |

"Lease" below is a sigil/leases.py lease: its key lives while its holder renews it, and
expires SIGIL_LEASE_SECONDS after the holder stops (or dies). "No expiry" means the key
lives until its writer deletes it (or Redis is flushed, which every owner survives: each
says how it rebuilds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


def key_family(prefix: str) -> Callable[[str], str]:
    """The names of one family of Redis keys, one key per thing named:
    key_family("sigil:breaker:open")("alice--x") is "sigil:breaker:open:alice--x". Called with
    "" it gives the family's prefix (for a SCAN of the family)."""
    return f"{prefix}:{{}}".format


# --- tokens (agents) ------------------------------------------------------------------------

#: One token's authority, by the sha256 of its secret (agents/tokens.py: encode): usable, a
#: tombstone `-` (revoked, expired, unknown) or `-disabled`. Written by agents/services.py
#: after a token's or agent's change commits, filled by agents/selectors.py with SET NX.
#: Expires after tokens.POSITIVE_TTL_SECONDS (a tombstone after NEGATIVE_TTL_SECONDS).
token = key_family("sigil:token")

#: A hash, token hash → epoch of its latest use. Written by the gateway's record script
#: (books/stats.py: RECORD_CALLS) and tokens.stamp_used (API, MCP); the stats flush moves
#: each stamp to Token.last_used_at and forgets it. No expiry.
TOKENS_USED = "sigil:tokens:used"

#: Failed authentications from one client address, a counter. Written by
#: agents/throttle.py (FailedAuthThrottle.failed). Expires SIGIL_AUTH_FAILURE_WINDOW_SECONDS
#: after the first failure of the window.
auth_failures = key_family("sigil:authfail")


def token_issued(token_id: int, session_digest: str) -> str:
    """A new token's secret, for the one page that shows it to the session that issued it
    (`session_digest`: the sha256 of its session key). Written by agents/admin.py
    (issued_secret_keep), deleted as it is read. Expires after ISSUED_SECRET_SECONDS (2 min)."""
    return f"sigil:token-issued:{token_id}:{session_digest}"


# --- a capability's copies, read on every call (capabilities/books) ---------------------

#: A capability's route (books/routes.py: encode) or the tombstone `-`. Written by
#: books/copies.py (copies_publish, after each write of its row commits; the page-out's
#: turn-away), filled by routes.route_load with SET NX. Expires after routes.TTL_SECONDS
#: (a tombstone after routes.NEGATIVE_TTL_SECONDS).
route = key_family("sigil:route")

#: A capability's current contract (books/contract_copies.py: encode) or the tombstone `-`.
#: Written by books/copies.py with the route, filled by contract_copies.contract_load with
#: SET NX. Expires as the route does (contract_copies.TTL_SECONDS).
contract = key_family("sigil:contract")


# --- what calls leave behind, until the stats flush (capabilities/books/stats.py) ---------

#: A hash of one capability's counters since the last flush (calls, errors, latency, buckets,
#: answers by status class and code, cold starts, last access). Written by the gateway
#: (RECORD_CALLS, ANSWER_COUNT) and edge reports; moved out by the flush (CLAIM_STATS).
#: No expiry: the flush deletes it.
stats = key_family("sigil:stats")

#: A set of the full names with counters the flush has not claimed. Written with the
#: counters; emptied by the flush. No expiry.
STATS_DIRTY = "sigil:stats:dirty"

#: A sorted set of flush ids → when their batch was claimed: batches claimed and not yet
#: released. Written by the flush (CLAIM_STATS, stats_release). No expiry.
STATS_PENDING = "sigil:stats:pending"

#: A hash of one claimed batch, full name → its counters (JSON). Written by the flush
#: (CLAIM_STATS), deleted once the database holds it. No expiry.
stats_batch = key_family("sigil:stats:batch")

#: A hash of the running totals, by status class and code, of answers that named no
#: capability (for /metrics). Written by ANSWER_COUNT. No expiry (kept in Redis only).
STATS_UNROUTED_TOTALS = "sigil:stats:unrouted-totals"

#: A list of the last calls, `epoch|full|type` each, at most SIGIL_ACCESS_PATTERN_MAX_CALLS:
#: the access pattern the cost estimate replays (capabilities/cost.py). Written by
#: RECORD_CALLS, trimmed there. No expiry.
ACCESS_LOG = "sigil:access:log"

#: Calls sent to a split's staged version (by its variant name) and refused by its own
#: breaker, a counter. Written by books/stats.py (split_refusal_count); deleted when the
#: split ends (split_forget). No expiry.
split_refused = key_family("sigil:split:refused")

#: Present while a split guard run was asked for lately (by variant name). Written by
#: split_refusal_count. Expires after SPLIT_GUARD_DEBOUNCE_MS.
split_guard_due = key_family("sigil:split:guard-due")


# --- the breaker and failures (capabilities/books/breaker.py, failures.py) ----------------

#: A capability's breaker: absent while closed, `forced` while the owner forced it, else the
#: epoch its cool-down ends (half-open after). Written by RECORD_OUTCOME_LUA (inside
#: RECORD_CALLS), breaker_force and breaker_reset. No expiry.
breaker_open = key_family("sigil:breaker:open")

#: Failures in a row since the last success, a counter. Written by RECORD_OUTCOME_LUA;
#: deleted by a success and breaker_reset. No expiry.
breaker_failures = key_family("sigil:breaker:failures")

#: Held by a half-open breaker's one trial call. Written by Breaker.enter; deleted when the
#: trial is recorded or the breaker is reset. Expires after one cool-down.
breaker_trial = key_family("sigil:breaker:trial")

#: Who forced a breaker open and when (JSON). Written by breaker_force; deleted by
#: breaker_reset. No expiry.
breaker_forced_by = key_family("sigil:breaker:forced-by")

#: A list of a capability's recent failures (books/failures.py: failure_encode), newest
#: first, at most SIGIL_FAILURES_KEPT. Written by RECORD_CALLS; deleted when the capability
#: is removed (failures_forget). No expiry: the list is capped instead.
failures = key_family("sigil:failures")


# --- call records (capabilities/books/call_logs.py) -------------------------------------

#: A list of a capability's call records (JSON), newest first, at most
#: SIGIL_LOGS_RECORDS_PER_CAPABILITY, none older than SIGIL_LOGS_RETENTION_SECONDS (pruned
#: as records are kept and read). Written by call_logs (call_records_keep). No expiry.
logs = key_family("sigil:logs")

#: A hash of one agent's records, full name → the bytes they hold; their sum stays under
#: SIGIL_LOGS_AGENT_BYTES. Written with the records. No expiry.
logs_bytes = key_family("sigil:logs:bytes")

#: The sequence number every kept record takes (the tail's and the pages' cursor), a
#: counter. Written with the records. No expiry.
LOGS_SEQ = "sigil:logs:seq"

#: A hash, full name → records that could not be kept (over the agent's bytes, refused by
#: the sink). Written by call_logs. No expiry (deleted with the capability's records).
LOGS_LOST = "sigil:logs:lost"

#: Records the runtime lost before they reached Sigil, and batches the sink could not read,
#: a counter (on /metrics). Written by call_logs (call_records_undelivered). No expiry.
LOGS_UNDELIVERED = "sigil:logs:lost:undelivered"

#: A hash, full name → the part of LOGS_UNDELIVERED counted for that capability (its owner
#: sees it). Written with LOGS_UNDELIVERED. No expiry.
LOGS_UNDELIVERED_BY = "sigil:logs:lost:undelivered:by"

#: Present once a batch of records pushed from Cloudflare was taken (by batch id), so that
#: the same batch pushed again is kept once. Written by call_logs (call_records_batch_claim).
#: Expires after the records' retention.
logs_taken = key_family("sigil:logs:taken")

#: Pushed batches taken, a counter (on /metrics). Written with logs_taken. No expiry.
LOGS_PUSHES = "sigil:logs:pushes"

#: Pushed batches that had been taken already, and were ignored, a counter (on /metrics).
#: Written with logs_taken. No expiry.
LOGS_PUSHES_AGAIN = "sigil:logs:pushes:again"


# --- the degraded cache (capabilities/books/degraded_cache.py) --------------------------

#: A hash of a capability's last good answers, a GET's path and query → the answer (status,
#: headers, body, when). Written by the gateway (degraded_cache STORE) for capabilities that
#: opted in. Expires SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS after the last store.
degraded_cache = key_family("sigil:degraded-cache")

#: A sorted set of the same paths by when they were stored, so that only the newest
#: SIGIL_DEGRADED_CACHE_MAX_ENTRIES are kept. Written and expiring with degraded_cache.
degraded_cache_index = key_family("sigil:degraded-cache-index")


# --- the pager (capabilities/books/pager.py) --------------------------------------------


def lru(capability_type: str) -> str:
    """A sorted set of the placed and served capabilities of one type (ephemeral, normal,
    persistent), by last access. Written by the pager's scripts and RECORD_CALLS (the access
    stamp). No expiry: rebuilt from the registry when lost (pager_ensure_built)."""
    return f"sigil:lru:{capability_type}"


#: A sorted set of the ephemerals among the placed, by expiry time. Written by the pager's
#: scripts. No expiry (rebuilt with the LRU sets).
LRU_EXPIRY = "sigil:lru:expiry"

#: A sorted set of the capabilities being placed (a page-in, a deploy) by the holder of their
#: placement lock. Written by the pager's scripts. No expiry (rebuilt with the LRU sets).
LRU_PLACING = "sigil:lru:placing"

#: A sorted set of victims and removed capabilities whose script is still on the runtime.
#: Written by the pager's scripts. No expiry (rebuilt with the LRU sets).
LRU_EVICTING = "sigil:lru:evicting"

#: Present once the pager's sets were built from the registry. Written by pager_rebuild.
#: No expiry: its absence (Redis lost them) makes the next caller rebuild them.
LRU_BUILT = "sigil:lru:built"

#: Evictions the pager has chosen, a counter. Written by the pager's scripts. No expiry.
LRU_EVICTIONS = "sigil:lru:evictions"

#: A set of the victims a placement of a capability chose: if it dies before it ends, they
#: are paged out. Written by pager_note_chosen, taken by pager_take_chosen. Expires after
#: a day.
lru_chosen = key_family("sigil:lru:chosen")

#: The lease held while one process rebuilds the pager's sets. Written by
#: pager_ensure_built. A lease (held at most a minute).
LRU_REBUILD_LOCK = "sigil:lock:lru-rebuild"

#: A hash of the calls in flight to a capability, process id → count. Written by
#: pager_inflight_enter and RECORD_CALLS (its release); entries of dead processes are
#: dropped by pager_inflight. No expiry.
inflight_by_process = key_family("sigil:inflight-by-process")

#: A sorted set of page-outs sent or waiting on calls in flight, full name → when their task
#: should next run (epoch s); one past that by a lease was lost with its worker and is sent
#: again (services/reaper.py). Written by capabilities/services/page_outs.py. No expiry.
PAGE_OUTS_DUE = "sigil:pageout:due"

#: Why the runtime's account refused a newcomer, for /_health. Written by
#: capabilities/services/room.py. Expires after ACCOUNT_FULL_REPORTED_SECONDS (an hour).
ACCOUNT_FULL = "sigil:runtime:account_full"


# --- deploys and placements (capabilities/services) -------------------------------------

#: Held for one deploy cool-down after an agent's real deploy. Written by
#: services/versions.py (cooldown_claim). Expires after SIGIL_DEPLOY_COOLDOWN_SECONDS.
cooldown = key_family("sigil:cooldown")

#: The lease that orders the recording of deploys of one capability. Written by
#: services/versions.py (deploy_lock). A lease (held at most DEPLOY_RECORD_LOCK_SECONDS).
deploy_lock = key_family("sigil:lock:deploy")

#: A capability's placement lock (one placement at a time). Written by
#: services/placement_lock.py. A lease (held at most SIGIL_PLACEMENT_LOCK_SECONDS).
place_lock = key_family("sigil:lock:place")


def deploy_outcome(version_id: int) -> str:
    """A list holding a deploy's outcome for the request that waits on it. Written by
    services/deploy_task.py. Expires after OUTCOME_KEEP_SECONDS (2 min)."""
    return f"sigil:deploy:outcome:{version_id}"


def deploy_owner(version_id: int) -> str:
    """The lease of the task placing a version: a version nobody owns (nor deploy_retry) was
    stranded by a dead worker. Written by services/deploy_task.py. A lease."""
    return f"sigil:deploy:owner:{version_id}"


def deploy_retry(version_id: int) -> str:
    """Present while a retry of a version's task is due. Written by services/deploy_task.py.
    Expires after the retry's countdown and a lease."""
    return f"sigil:deploy:retry:{version_id}"


def deploy_resent(version_id: int) -> str:
    """How often a stranded version's task was sent again, a counter. Written by
    services/deploy_task.py (the reaper's resend). Expires after a day."""
    return f"sigil:deploy:resent:{version_id}"


#: The lease of the one prewarm run at a time. Written by services/lifecycle.py. A lease
#: (held at most CELERY_TASK_SOFT_TIME_LIMIT).
PREWARM_LEASE = "sigil:prewarm:run"

#: Present while a capability's error-rate alert was sent lately. Written by
#: services/observability.py. Expires after SIGIL_ALERT_COOLDOWN_SECONDS.
error_rate_alert = key_family("sigil:alert:error-rate")


def cost_slots(days: float) -> str:
    """The smallest slot count the access pattern of the last `days` needs (cost estimate),
    "" for none. Written by capabilities/cost.py. Expires after SLOTS_KEPT_SECONDS (5 min)."""
    return f"sigil:cost:slots:{days:g}"


# --- asynchronous calls (capabilities/services/async_calls.py) ---------------------------

#: A list of the calls accepted and not yet taken by a runner, oldest at the right. Written
#: by async_calls (accept) and the runners (capabilities/engine/runner.py). No expiry.
ASYNC_QUEUE = "sigil:async:queue"

#: A hash, one call's execution record: the request, then `running`, then `done` with the
#: result. Written by async_calls and the runners. Expires after SIGIL_ASYNC_RESULT_TTL_SECONDS
#: (from acceptance, and again from its result).
async_call = key_family("sigil:async")

#: A list of the calls one runner has taken and not finished (by runner id). Written by the
#: runners. No expiry: a runner whose lease lapsed has its calls put back by another.
async_taken = key_family("sigil:async:taken")

#: Present while a runner lives (by runner id). Written by the runner, renewing it. Expires
#: when the runner stops renewing it.
async_runner = key_family("sigil:async:runner")

#: A sorted set of an agent's calls accepted and not yet run, call id → when accepted.
#: Written by async_calls (_ADMIT) and the runners. Expires with the records' life.
async_pending = key_family("sigil:async:pending")


# --- the edge (sigil/edge_state.py, capabilities/services/edge.py, edge_reports.py) -------

#: A set of the edge's keys (as named in Workers KV) whose value may have changed since it
#: was last published. Written by sigil/edge_state.py (edge_mark), taken by the publisher.
#: No expiry.
EDGE_DIRTY = "sigil:edge:dirty"

#: A set of the keys a publisher took from EDGE_DIRTY and has not written yet. Written by
#: services/edge.py. No expiry (given back to EDGE_DIRTY when a write fails).
EDGE_PUBLISHING = "sigil:edge:publishing"

#: The lease of the one publisher at a time. Written by services/edge.py. A lease.
EDGE_PUBLISHER_LEASE = "sigil:edge:publisher"

#: A hash of the publisher's standing: its last publish, its last failure, failures in a
#: row. Written by services/edge.py. No expiry.
EDGE_STANDING = "sigil:edge:standing"

#: A hash of two counters (on /metrics), the edge's reports applied and those lost on the
#: way. Written by services/edge_reports.py (books/stats.py: edge_reports_count_queue).
#: No expiry.
EDGE_REPORTS = "sigil:edge:reports"

#: Present once a pushed batch of the edge's reports was applied (by batch id), as long as
#: the Worker may push it again. Written by services/edge_reports.py. Expires after the
#: records' retention (call_records_push gives it).
edge_reports_taken = key_family("sigil:edge:reports:taken")


# --- Cloudflare's API (capabilities/runtimes/cloudflare) ---------------------------------

#: Every API call made, a counter (on /metrics). Written by the client. No expiry.
CF_CALLS = "sigil:cf:calls"

#: Every 429 the API answered, a counter (on /metrics). Written by the client. No expiry.
CF_RATE_LIMITED = "sigil:cf:rate_limited"

#: A hash of API calls by the class of work they were made for (api_work.ApiClass).
#: Written by the client. No expiry.
CF_CALLS_BY_CLASS = "sigil:cf:calls:by_class"

#: A hash of API calls by operation (client.OPERATIONS). Written by the client. No expiry.
CF_CALLS_BY_OPERATION = "sigil:cf:calls:by_operation"


def cf_calls_hour(hour: int) -> str:
    """API calls in one hour since the epoch, a counter (the cost estimate's budget). Written
    by the client. Expires after API_CALLS_HOURS_KEPT hours."""
    return f"sigil:cf:calls:hour:{hour}"


def cf_calls_hour_by_class(hour: int) -> str:
    """The same hour's calls by class, a hash. Written and expiring with cf_calls_hour."""
    return f"sigil:cf:calls:hour:{hour}:by_class"


def cf_calls_hour_by_operation(hour: int) -> str:
    """The same hour's calls by operation, a hash. Written and expiring with cf_calls_hour."""
    return f"sigil:cf:calls:hour:{hour}:by_operation"


class BudgetKeys(NamedTuple):
    """The keys of one rate budget (runtimes/cloudflare/budget.py), under one hash tag, so
    that they share one slot on Redis Cluster."""

    #: a sorted set of the requests in the window, by when made; expires with the window
    window: str
    #: present while the API's 429 pauses every class; expires with the pause
    pause: str
    #: the housekeeping class's own requests in the window; expires with the window
    housekeeping: str


def budget(name: str) -> BudgetKeys:
    """The keys of the rate budget `name`. Written by RateBudget's scripts; each expires as
    BudgetKeys says."""
    tag = f"{{{name}}}"
    return BudgetKeys(f"{tag}:window", f"{tag}:pause", f"{tag}:housekeeping")


def cf_budget(account_id: str) -> BudgetKeys:
    """The Cloudflare API's rate budget of one account. Written by the client's RateBudget;
    each key expires as BudgetKeys says."""
    return budget(f"sigil:cf:budget:{account_id}")


#: A hash of one account's facts (by account id): `subdomain`, `kv:{title}` (a KV
#: namespace's id). Written by runtimes/cloudflare/facts.py, from the API. No expiry (a fact
#: found wrong is forgotten and asked again).
cf_facts = key_family("sigil:cf:facts")


def sigil_worker_lock(account_id: str, name: str) -> str:
    """The lease of the process uploading one of Sigil's own Workers. Written by
    runtimes/sigil_worker.py (SigilWorker.deploy). A lease (held at most DEPLOY_LOCK_SECONDS)."""
    return f"sigil:lock:sigil-worker:{account_id}:{name}"


# --- processes -----------------------------------------------------------------------------

#: Present while a process lives (by process id): what marks held per process (the pager's
#: in-flight counts) are judged by. Written by sigil/leases.py's renewing thread. Expires
#: SIGIL_LEASE_SECONDS after the process stops renewing it.
process = key_family("sigil:process")

#: The lease of the one beat that sends the schedule. Written by sigil_site/beat_leader.py.
#: A lease, held for as long as that beat runs.
BEAT_LEADER = "sigil:beat:leader"

#: A hash, periodic task → when a worker last finished it and how (JSON). Written by
#: sigil_site/beat.py (from celery.py's signal handlers). No expiry.
BEAT_LAST_RUN = "sigil:beat:last-run"

#: One MCP session: `token hash|protocol version`. Written by capabilities/mcp/endpoint.py.
#: Expires after SESSION_IDLE_SECONDS (a day) without a request.
mcp_session = key_family("sigil:mcp:session")

#: The prefix of every key of Django's cache (django-axes' failed logins, …), which is Redis
#: too (settings.CACHES). Written by Django's cache, expiring as each entry's timeout says.
DJANGO_CACHE_PREFIX = "sigil:django"

#: Scratch keys of a benchmark. Written and deleted by the benchmark itself (bench/); no expiry.
bench = key_family("sigil:bench")
