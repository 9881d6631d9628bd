// The report channel of Sigil's Workers: what they tell Sigil of the calls they saw, in batches.
// Two kinds of item travel in a batch: call records (a capability's tail: host.js callRecord)
// and the edge's reports of the calls it answered itself (edge.js report), the counters,
// breaker outcome, failure record, token last-use and pager access the origin applies for
// them as for its own calls (capabilities/services/edge_reports.py). Both go the same way, one
// push carrying whatever gathered of either.
//
// The items of calls that ended close together travel in one batch: each call only queues its
// item, and the call that finds no batch on its way waits a moment, then sends what has
// gathered (again, until nothing is left). One subrequest per batch rather than per call is
// what keeps the channel's share of the event loop small. The queue is bounded: what is
// dropped past it is counted in the next batch, so Sigil counts it as lost. Every call record
// lost on the way (past the queue, a batch the sink or the origin refused, one neither pushed
// nor spooled) is counted for the capability (the slot) it was of, in the next batch's
// `dropped_by`, so that the capability's owner sees the loss, not only the operator. A
// failure the edge reports does not wait for the rest of the moment (`deliver`'s `urgent`):
// the breaker at the origin must count it before the calls that follow.
//
// Where a batch goes: to the local runtime's log sink (LOG_SINK, a service on this machine),
// or, on Cloudflare, pushed to Sigil's origin (SIGIL_RECORDS_URL), signed with
// SIGIL_RECORDS_KEY (HMAC-SHA256 over the time of signing and the exact body: see push). A
// push carries an id, so a batch pushed twice is kept once. A batch the origin does not take
// (no connection, a timeout, a 5xx) waits in the Worker's own KV namespace (LOG_KV where the
// Worker keeps call records, else the edge's EDGE_KV; through its binding: no API request)
// until the origin takes batches again (see spool and drain).

const SECRET_HEADER = "x-sigil-secret";
const FLUSH_MS = 50;
// Pushed batches wait longer: one push a second or so carries everything of that second.
const PUSH_FLUSH_MS = 1000;
// How long a push may take before the batch is spooled instead.
const PUSH_TIMEOUT_MS = 10_000;
// At most this many records in one batch (the sink and the origin refuse larger bodies:
// capabilities/log_limits.py, LogLimits.batch_bytes, which LOG_LIMITS carries as batchBytes).
const BATCH_RECORDS = 64;
// At most this many of the edge's reports in one batch (the origin refuses more:
// capabilities/services/edge_reports.py, REPORTS_PER_BATCH).
const BATCH_REPORTS = 512;
// What the queue may hold, roughly in bytes of text: past it, items are dropped (and counted).
const MAX_PENDING_BYTES = 8 * 1024 * 1024;
const SIGNED_AT_HEADER = "x-sigil-signed-at";
const SIGNATURE_HEADER = "x-sigil-signature";
const SPOOL_PREFIX = "spool:";
// Spooled batches one flush pushes at most; the rest wait for the next flush.
const DRAIN_BATCHES = 32;
// After a batch was spooled, the pauses before the spool is tried again in the same flush.
const RETRY_PAUSES_MS = [1000, 3000, 8000];
const pending = []; // call records
const reports = []; // the edge's reports
let pendingBytes = 0;
let dropped = 0; // call records lost since the last batch that got through
let droppedBy = {}; // of them, per capability (slot): the batch's dropped_by
// At most this many capabilities named in one batch's dropped_by; a loss past it is counted
// in `dropped` alone (Sigil's undelivered count, no capability's).
const DROPPED_BY_SLOTS = 256;
let reportsDropped = 0; // reports lost since the last batch that got through
let flushing = false;
// A failure was reported: the flush under way stops waiting for more (see pause).
let urgent = false;
let wake = null;

function sizeOf(record) {
  let size = 512;
  for (const line of record.logs) size += line.text.length + 48;
  if (record.exception) size += record.exception.stack.length + record.exception.message.length;
  return size;
}

// A report is a few hundred bytes of JSON, its strings bounded by the edge (a failure's message).
function reportSize(report) {
  return 384 + (report.message ? report.message.length : 0) + (report.path ? report.path.length : 0);
}

// Count lost call records: `total` of them, `by` capability (slot) as far as known.
function lose(total, by) {
  dropped += total;
  for (const [slot, count] of Object.entries(by)) {
    if (!(slot in droppedBy) && Object.keys(droppedBy).length >= DROPPED_BY_SLOTS) continue;
    droppedBy[slot] = (droppedBy[slot] || 0) + count;
  }
}

function loseRecords(records) {
  const by = {};
  for (const record of records) by[record.capability] = (by[record.capability] || 0) + 1;
  lose(records.length, by);
}

// What was lost since the last batch that got through, for the next batch (and forgotten here).
function takeLost() {
  const lost = [dropped, droppedBy];
  dropped = 0;
  droppedBy = {};
  return lost;
}

/** Queue one call record for the next batch; past the queue's bound it is dropped, and counted. */
export function queueRecord(record) {
  const size = sizeOf(record);
  if (pendingBytes + size > MAX_PENDING_BYTES) {
    loseRecords([record]);
    return;
  }
  pending.push(record);
  pendingBytes += size;
}

/** Queue one of the edge's reports for the next batch; past the queue's bound it is dropped, and counted. */
export function queueReport(report) {
  const size = reportSize(report);
  if (pendingBytes + size > MAX_PENDING_BYTES) {
    reportsDropped += 1;
    return;
  }
  reports.push(report);
  pendingBytes += size;
}

/**
 * Send what is queued, unless a flush under way will (resolves once this one's flush is done,
 * so that a caller's waitUntil keeps the isolate for it). With `urgent`, what is queued goes
 * without waiting for the rest of the moment, a flush under way included.
 */
export async function deliver(env, limits, { urgent: now = false } = {}) {
  if (now) {
    urgent = true;
    if (wake) wake();
  }
  if (flushing || !waiting()) return;
  await flush(env, limits);
}

/** LOG_LIMITS, the bounds the origin gives the channel, with their defaults. */
export function channelLimits(env) {
  const limits = JSON.parse(env.LOG_LIMITS || "{}");
  limits.lines = limits.lines ?? 200;
  limits.lineBytes = limits.lineBytes ?? 2048;
  return limits;
}

function waiting() {
  return pending.length > 0 || reports.length > 0 || dropped > 0 || reportsDropped > 0;
}

// The origin did not take a batch now: no connection, a timeout, a 5xx or a 429. Worth spooling.
class OriginUnreachable extends Error {}

const encoder = new TextEncoder();
let signingKey = null; // [key text, CryptoKey]: imported once per SIGIL_RECORDS_KEY

async function signature(keyText, signedAt, body) {
  if (!signingKey || signingKey[0] !== keyText) {
    const key = await crypto.subtle.importKey(
      "raw",
      encoder.encode(keyText),
      { name: "HMAC", hash: "SHA-256" },
      false,
      ["sign"],
    );
    signingKey = [keyText, key];
  }
  const mac = await crypto.subtle.sign("HMAC", signingKey[1], encoder.encode(`${signedAt}.${body}`));
  return [...new Uint8Array(mac)].map((byte) => byte.toString(16).padStart(2, "0")).join("");
}

// Push one batch's body (JSON, with its id) to the origin. Resolves once the origin took it (or
// had taken it before); throws OriginUnreachable when it should be tried again later, any
// other error when the origin refused it for good (a bad signature, a malformed batch).
async function push(env, body) {
  const signedAt = String(Math.floor(Date.now() / 1000));
  const headers = {
    "content-type": "application/json",
    [SIGNED_AT_HEADER]: signedAt,
    [SIGNATURE_HEADER]: await signature(env.SIGIL_RECORDS_KEY, signedAt, body),
  };
  let response;
  try {
    response = await fetch(env.SIGIL_RECORDS_URL, {
      method: "POST",
      headers,
      body,
      signal: AbortSignal.timeout(PUSH_TIMEOUT_MS),
    });
  } catch (error) {
    throw new OriginUnreachable(`the origin was not reached: ${error}`);
  }
  const answer = await response.text().catch(() => "");
  if (response.ok) return;
  if (response.status >= 500 || response.status === 429 || response.status === 408) {
    throw new OriginUnreachable(`the origin answered ${response.status}`);
  }
  throw new Error(`the origin refused a batch with ${response.status}: ${answer.slice(0, 300)}`);
}

// Where this Worker spools: LOG_KV, the namespace it keeps call records in (the loader's, the
// Tail Worker's), else the edge's own (EDGE_KV: its `spool:` keys are none of the edge's state).
function spoolKv(env) {
  return env.LOG_KV || env.EDGE_KV || null;
}

// What the spool remembers in this isolate: the keys it wrote and has not seen drained, how
// many it wrote since it last found the spool empty (its bound), and whether it has listed
// the spool since it started (a fresh isolate lists once, on its first push the origin takes,
// for what isolates before it left there).
const spooled = new Set();
let spooledSinceEmpty = 0;
let spoolListed = false;
let spoolMore = false;

// Keep a batch the origin did not take in the spool until it does, for the records' retention
// (KV's own expiry). False when it cannot: no KV binding, the bound reached, a failed write.
async function spool(env, limits, body, batchId) {
  const kv = spoolKv(env);
  if (!kv || spooledSinceEmpty >= (limits.spoolBatches ?? 100)) return false;
  const key = `${SPOOL_PREFIX}${String(Date.now()).padStart(15, "0")}:${batchId}`;
  try {
    await kv.put(key, body, { expirationTtl: Math.max(60, limits.retentionSeconds || 86400) });
  } catch (error) {
    console.error(`a batch of call records and reports not spooled: ${error}`);
    return false;
  }
  spooled.add(key);
  spooledSinceEmpty += 1;
  return true;
}

function spoolWaiting() {
  return spooled.size > 0 || !spoolListed || spoolMore;
}

// Push what waits in the spool, oldest first, once the origin takes batches again: through the
// binding (list, get, push, delete), at most DRAIN_BATCHES a flush. Another isolate may push
// the same batch meanwhile: the origin keeps it once. Returns false when the origin stopped
// taking them.
async function drain(env) {
  const keys = new Set(spooled);
  const listing = await spoolKv(env).list({ prefix: SPOOL_PREFIX, limit: DRAIN_BATCHES });
  for (const key of listing.keys) keys.add(key.name);
  spoolListed = true;
  spoolMore = !listing.list_complete;
  let pushed = 0;
  for (const key of [...keys].sort()) {
    if (pushed >= DRAIN_BATCHES) {
      spoolMore = true;
      return true;
    }
    pushed += 1;
    if (!(await pushSpooled(env, key))) return false;
  }
  if (!spoolMore && spooled.size === 0) spooledSinceEmpty = 0;
  return true;
}

// Push one spooled batch and delete it; one the origin refuses for good is deleted too, its
// items counted as lost in the next batch. False when the origin is out of reach (it stays).
async function pushSpooled(env, key) {
  const kv = spoolKv(env);
  const body = await kv.get(key);
  if (body !== null) {
    try {
      await push(env, body);
    } catch (error) {
      if (error instanceof OriginUnreachable) return false;
      const [records, recordsBy, lostReports] = itemsIn(body);
      lose(records, recordsBy);
      reportsDropped += lostReports;
      console.error(`a spooled batch refused: ${error}`);
    }
    await kv.delete(key);
  }
  spooled.delete(key);
  return true;
}

// The call records (in all, and by capability) and the reports a batch's body stands for,
// those it says were lost included.
function itemsIn(body) {
  try {
    const batch = JSON.parse(body);
    const kept = Array.isArray(batch.records) ? batch.records : [];
    const by = { ...(batch.dropped_by || {}) };
    for (const record of kept) by[record.capability] = (by[record.capability] || 0) + 1;
    const lostReports = (Array.isArray(batch.reports) ? batch.reports.length : 0) + (batch.reports_dropped || 0);
    return [kept.length + (batch.dropped || 0), by, lostReports];
  } catch {
    return [0, {}, 0];
  }
}

// The next batch from the queue: at most BATCH_RECORDS records and BATCH_REPORTS reports and,
// with `maxBytes` (pushes), that many bytes of JSON (but at least one item). The log sink's
// batches are not measured: the per-call bounds keep BATCH_RECORDS of them within its bound,
// but for JSON's escaping, and the local runtime's calls should not pay for measuring.
function nextBatch(maxBytes) {
  let records;
  const taken = [];
  if (maxBytes) {
    records = [];
    let bytes = 256;
    const fits = (item) => {
      const size = encoder.encode(JSON.stringify(item)).byteLength + 1;
      if ((records.length || taken.length) && bytes + size > maxBytes) return false;
      bytes += size;
      return true;
    };
    while (pending.length && records.length < BATCH_RECORDS && fits(pending[0])) records.push(pending.shift());
    while (reports.length && taken.length < BATCH_REPORTS && fits(reports[0])) taken.push(reports.shift());
  } else {
    records = pending.splice(0, BATCH_RECORDS);
    taken.push(...reports.splice(0, BATCH_REPORTS));
  }
  for (const record of records) pendingBytes -= sizeOf(record);
  for (const report of taken) pendingBytes -= reportSize(report);
  return [records, taken];
}

async function flush(env, limits) {
  flushing = true;
  try {
    await pause(env.SIGIL_RECORDS_URL ? PUSH_FLUSH_MS : FLUSH_MS);
    if (!env.SIGIL_RECORDS_URL) {
      await deliverToSink(env);
      return;
    }
    let reachable = await deliverPushed(env, limits, true);
    // What was spooled a moment ago is tried again a few times while this invocation may run
    // (waitUntil), so that the items of a burst's last calls do not wait for the next call.
    // Each try pushes the oldest batch this isolate spooled: a KV read, no listing.
    for (const wait of RETRY_PAUSES_MS) {
      if (reachable || !spoolKv(env) || !spooled.size) break;
      await sleep(wait);
      reachable = await pushOldestSpooled(env);
    }
    if (waiting()) await deliverPushed(env, limits, reachable);
  } finally {
    flushing = false;
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// Wait `ms`, or less once a failure is reported (urgent), which this consumes.
async function pause(ms) {
  if (!urgent) {
    await new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      wake = () => {
        clearTimeout(timer);
        resolve();
      };
    });
    wake = null;
  }
  urgent = false;
}

async function deliverToSink(env) {
  let sentAt = 0;
  while (pending.length || dropped) {
    // What queued while a batch was sent waits for the rest of its moment, unless a whole
    // batch is there: under a steady load the loop would otherwise send, one after the other,
    // the few records that end during each send (a sink request per one to three calls).
    const wait = sentAt + FLUSH_MS - Date.now();
    if (sentAt && wait > 0 && pending.length < BATCH_RECORDS) await pause(wait);
    sentAt = Date.now();
    const [records] = nextBatch(0);
    const [lost, lostBy] = takeLost();
    try {
      await send(env, { records, dropped: lost, dropped_by: lostBy });
    } catch (error) {
      // Sigil is not taking them now: the next batch that gets through says how many were lost.
      lose(lost, lostBy);
      loseRecords(records);
      console.error(`call records not delivered: ${error}`);
      return;
    }
  }
}

// Push the queue's batches to the origin (straight to the spool once it is out of reach);
// drain the spool after a push the origin took. Returns whether the origin is reachable.
async function deliverPushed(env, limits, reachable) {
  let pushedAt = 0;
  while (waiting()) {
    // What queued while a batch was pushed waits for the rest of its second, unless a whole
    // batch is there or a failure is: one push a second, whatever the rate below a batch a second.
    const wait = pushedAt + PUSH_FLUSH_MS - Date.now();
    const whole = pending.length >= BATCH_RECORDS || reports.length >= BATCH_REPORTS;
    if (pushedAt && reachable && wait > 0 && !whole) await pause(wait);
    else urgent = false;
    pushedAt = Date.now();
    const [records, taken] = nextBatch(limits.batchBytes);
    const [lost, lostBy] = takeLost();
    const lostReports = reportsDropped;
    reportsDropped = 0;
    // LOG_SLOTS (Sigil's Tail Worker): the records name the runtime's slot, and Sigil masks
    // their secrets as it takes them (capabilities/services/call_records.py).
    const id = crypto.randomUUID();
    const batch = { id, records, dropped: lost, dropped_by: lostBy };
    if (env.LOG_SLOTS) batch.slots = true;
    if (taken.length || lostReports) {
      batch.reports = taken;
      batch.reports_dropped = lostReports;
    }
    const body = JSON.stringify(batch);
    try {
      if (!reachable) throw new OriginUnreachable("the origin was out of reach a moment ago");
      await push(env, body);
    } catch (error) {
      if (error instanceof OriginUnreachable) reachable = false;
      if (error instanceof OriginUnreachable && (await spool(env, limits, body, id))) continue;
      // Refused, or not kept for later: the next batch that gets through says how many were
      // lost. Nothing more goes now (the next call's flush tries again).
      lose(lost, lostBy);
      loseRecords(records);
      reportsDropped += lostReports + taken.length;
      console.error(`${carried(records.length + lost, taken.length + lostReports)} not delivered: ${error}`);
      return reachable;
    }
    if (spoolKv(env) && spoolWaiting()) reachable = await drainQuietly(env);
  }
  return reachable;
}

// What a batch carried, in words.
function carried(records, reportsCarried) {
  if (!reportsCarried) return "call records";
  return records ? "call records and the edge's reports" : "the edge's reports";
}

// Push the oldest batch this isolate spooled, then, if the origin took it, the rest of the
// spool. Returns whether the origin took it.
async function pushOldestSpooled(env) {
  const [oldest] = [...spooled].sort();
  try {
    if (!(await pushSpooled(env, oldest))) return false;
  } catch (error) {
    console.error(`spooled batches not pushed now: ${error}`);
    return false;
  }
  return drainQuietly(env);
}

async function drainQuietly(env) {
  try {
    return await drain(env);
  } catch (error) {
    // What stays spooled is pushed by a later flush (or expires with the records' retention).
    console.error(`spooled batches not drained now: ${error}`);
    return true;
  }
}

async function send(env, batch) {
  const response = await env.LOG_SINK.fetch("http://sink/records", {
    method: "POST",
    headers: { "content-type": "application/json", [SECRET_HEADER]: env.SIGIL_SECRET },
    body: JSON.stringify(batch),
  });
  if (!response.ok) throw new Error(`the log sink answered ${response.status}`);
}
