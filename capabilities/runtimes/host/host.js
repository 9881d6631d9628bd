// Sigil's loader host: the one Worker that runs capability code through a Worker Loader.
//
// The gateway (or the Cloudflare emulator) sends each request here with two internal
// headers: the shared secret and the loader id `{name}@{sha}`, and optionally the call's CPU
// limit. The code bundle for `sha` comes from the CODE service (a disk directory locally) or
// from Workers KV (`env.CODE_KV`, key `code:{sha}`: the loader runtime on Cloudflare), is
// loaded once per id, and receives the request with Sigil's internal headers removed.
// Because the id carries the content hash, a new version gets a fresh isolate and an
// unchanged one is reused.
//
// A bundle's secrets are never stored in plain text: `sealed` holds them encrypted with
// AES-256-GCM under a key derived (HKDF-SHA256) from this host's SIGIL_SECRET, bound to the
// bundle's sha (capabilities/runtimes/base.py seals them). They are opened here, in memory,
// when the code is loaded; a bundle that does not open (sealed for another secret) is
// treated as missing, so Sigil places it again.
//
// With `x-sigil-validate: 1` the host only starts the code, as Cloudflare does at upload:
// it asks the loaded Worker for an entrypoint no capability has, so its top-level code runs
// but none of its handlers. 204 when it starts; 400 `invalid-code` with workerd's message
// (a syntax error, a top-level exception) when it does not.
//
// Old versions are released. workerd's loader keeps every named isolate for the life of the
// process, and drops one only when the code in it calls `abortIsolate()`; so the host runs each
// capability behind a small main module of its own that re-exports the capability's exports and
// adds an entrypoint that does just that. The host keeps two versions of a slot loaded (see
// VERSIONS_KEPT) and retires older ones as newer ones are called; `x-sigil-retire: 1` retires
// the id's isolate at once (the slot was removed): 204 whether or not it was loaded.
//
// With `x-sigil-store: 1` (the loader runtime only) the host writes the request's body, a
// stored bundle, to `code:{sha}` through its own KV binding: 204.
// Each capability carries a tail (the Worker Loader's `tails` option): the host's own
// SigilTail entrypoint, which workerd hands the call's tail events once the call is over
// (its console lines, uncaught exception and outcome), off the call's path. It shapes them
// into a call's record, bounded and with the capability's secret values replaced by their
// binding names, and posts the records to LOG_SINK (the local runtime's log sink) with the
// shared secret, which capability code never sees, so it cannot forge records; or, on
// Cloudflare (the loader runtime), pushes them to Sigil's origin (SIGIL_RECORDS_URL), signed
// with a key capability code never sees either (SIGIL_RECORDS_KEY), spooling in Workers KV
// (LOG_KV) what the origin does not take for now: the report channel, channel.js, which the
// edge's reports (edge.js) travel by too.

import { WorkerEntrypoint } from "cloudflare:workers";
import { channelLimits, deliver, queueRecord } from "./channel.js";

const SECRET_HEADER = "x-sigil-secret";
const LOADER_ID_HEADER = "x-sigil-loader-id";
const CPU_HEADER = "x-sigil-cpu-ms";
const ERROR_HEADER = "x-sigil-error";
const VERSION_HEADER = "x-sigil-version";
const HOST_HEADER = "x-sigil-host";
const VALIDATE_HEADER = "x-sigil-validate";
const RETIRE_HEADER = "x-sigil-retire";
const STORE_HEADER = "x-sigil-store";
const PROBE_ENTRYPOINT = "SigilStartProbe";
const RETIRE_ENTRYPOINT = "SigilRetire";
// A name no capability module has: Sigil names them main.js (CodeBundle.from_code).
const HOST_MAIN_MODULE = "sigil-host-main.js";
const CONSOLE_MODULE = "sigil-console.js";
// `_` is allowed because Cloudflare script names (which the emulator uses as the name) may hold it.
const LOADER_ID = /^[a-z0-9_][a-z0-9_-]*(?:--[a-z0-9][a-z0-9-]*)?@[0-9a-f]{64}$/;

function refuse(status, kind, message, env) {
  const headers = { "content-type": "application/json", [ERROR_HEADER]: kind };
  // Deployed as the loader runtime's Worker, the host says which source it runs, so Sigil's
  // start check can tell a current one from a stale one.
  if (env && env.SIGIL_HOST_VERSION) headers[VERSION_HEADER] = env.SIGIL_HOST_VERSION;
  return new Response(JSON.stringify({ error: kind, message }), { status, headers });
}

// A refusal whose message may quote the code (its start failed), with the secrets masked.
async function maskedRefusal(answer, secrets) {
  if (!secrets.length) return answer;
  const body = await answer.json();
  return new Response(JSON.stringify({ ...body, message: masked(body.message, secrets) }), answer);
}

function sameSecret(given, expected) {
  const encoder = new TextEncoder();
  const a = encoder.encode(given || "");
  const b = encoder.encode(expected || "");
  // timingSafeEqual needs equal lengths; comparing b with itself keeps the time constant.
  return a.byteLength === b.byteLength && b.byteLength > 0
    ? crypto.subtle.timingSafeEqual(a, b)
    : (crypto.subtle.timingSafeEqual(b, b), false);
}

async function readBundle(env, sha) {
  if (env.CODE_KV) {
    const bundle = await env.CODE_KV.get(`code:${sha}`, "json");
    if (bundle === null) throw new MissingCode(sha);
    return bundle;
  }
  const response = await env.CODE.fetch(`http://code/${sha}.json`);
  if (response.status === 404) throw new MissingCode(sha);
  if (!response.ok) throw new Error(`code store answered ${response.status} for ${sha}`);
  return response.json();
}

const SEAL_INFO = new TextEncoder().encode("sigil bundle secrets");
let sealKey = null; // [secret, key]: derived once per SIGIL_SECRET

async function unseal(sealed, secret, sha) {
  if (!sealKey || sealKey[0] !== secret) {
    const base = await crypto.subtle.importKey("raw", new TextEncoder().encode(secret), "HKDF", false, ["deriveKey"]);
    const params = { name: "HKDF", hash: "SHA-256", salt: new Uint8Array(0), info: SEAL_INFO };
    const aesKey = await crypto.subtle.deriveKey(params, base, { name: "AES-GCM", length: 256 }, false, ["decrypt"]);
    sealKey = [secret, aesKey];
  }
  const raw = Uint8Array.from(atob(sealed), (c) => c.charCodeAt(0));
  const aes = { name: "AES-GCM", iv: raw.subarray(0, 12), additionalData: new TextEncoder().encode(sha) };
  try {
    return JSON.parse(new TextDecoder().decode(await crypto.subtle.decrypt(aes, sealKey[1], raw.subarray(12))));
  } catch {
    throw new MissingCode(sha, "its secrets are sealed for another host secret");
  }
}

// The loader keeps what it loaded under a name: an isolate until the code in it aborts, and a
// load that failed for good. A retired isolate's name can still reach it as it goes away (the
// call fails with "script terminated for unknown reasons"). So each time a loader id's isolate
// went away (its code was missing, or it was retired) its next load takes a fresh name,
// `{id}#{n}`. The count is never reset, so no name is loaded twice; names only multiply on
// these events, one small entry per retired version for the life of the process.
const incarnations = new Map();

function cacheIdOf(loaderId) {
  const n = incarnations.get(loaderId) || 0;
  return n ? `${loaderId}#${n}` : loaderId;
}

function nextIncarnation(loaderId) {
  incarnations.set(loaderId, (incarnations.get(loaderId) || 0) + 1);
}

class MissingCode extends Error {
  constructor(sha, why = "") {
    super(why ? `the code stored for ${sha} cannot be loaded: ${why}` : `no code stored for ${sha}`);
  }
}

// Every bundle is loaded behind this main module of the host's own. It re-exports the
// capability's module unchanged; at the top level it refuses one that is not an ES module
// whose default export has a `fetch` handler, so such code fails the start check with these
// words instead of failing every call; and it adds the retire entrypoint, which the
// capability cannot replace (an explicit export wins over `export *`). The namespace import
// of cloudflare:workers keeps the module valid where `abortIsolate` is not offered.
function hostMainModule(capabilityMain) {
  const main = JSON.stringify(`./${capabilityMain}`);
  return `import "./${CONSOLE_MODULE}";
import * as workers from "cloudflare:workers";
import * as capability from ${main};
export * from ${main};
const handler = capability.default;
if (handler === undefined) {
  throw new Error("the code has no default export: a capability is an ES module with export default { async fetch(request, env, ctx) { ... } }");
}
const prototype = typeof handler === "function" ? handler.prototype : handler;
if (prototype === null || typeof prototype !== "object" || typeof prototype.fetch !== "function") {
  throw new Error("the code's default export has no fetch handler: a capability is an ES module with export default { async fetch(request, env, ctx) { ... } }");
}
export default handler;
export const ${RETIRE_ENTRYPOINT} = {
  fetch() {
    if (typeof workers.abortIsolate === "function") workers.abortIsolate("replaced or removed");
    return new Response(null, { status: 501 });
  },
};
`;
}

// The module the host's main module imports first, so that it runs before any of the
// capability's: it masks the capability's secrets in what its console prints, as
// `[secret NAME]`, before workerd (or Cloudflare) writes a line of it anywhere. A string, an
// error's stack, or an object's JSON that holds a value is printed masked; anything else as
// it was. The values are the ones the isolate holds in `env` anyway, in memory only. The
// Cloudflare scripts' entry modules mask alike, knowing the values only from `env` at each
// call (runtimes/cloudflare/sigil-mask.js): a change to what is masked goes to both.
function consoleModule(secrets) {
  const pairs = [];
  for (const [name, value] of Object.entries(secrets)) {
    if (!value) continue;
    pairs.push([name, value]);
    const escaped = JSON.stringify(value).slice(1, -1); // as it appears inside an object's JSON
    if (escaped !== value) pairs.push([name, escaped]);
  }
  pairs.sort((a, b) => b[1].length - a[1].length);
  return `const SECRETS = ${JSON.stringify(pairs)};
const holds = (text) => SECRETS.some(([, value]) => text.includes(value));
const mask = (text) => SECRETS.reduce((out, [name, value]) => out.split(value).join("[secret " + name + "]"), text);
function clean(arg) {
  if (typeof arg === "string") return holds(arg) ? mask(arg) : arg;
  let text;
  try {
    text = arg instanceof Error ? String(arg.stack || arg) : arg !== null && typeof arg === "object" ? JSON.stringify(arg) : undefined;
  } catch {
    return arg;
  }
  return typeof text === "string" && holds(text) ? mask(text) : arg;
}
if (SECRETS.length) {
  // Every method (log, error, assert, count, group, timeLog, ...): each may print its arguments.
  for (const method of Object.keys(console)) {
    const original = console[method];
    if (typeof original === "function") console[method] = (...args) => original.apply(console, args.map(clean));
  }
}
`;
}

// What a retire loads when the id is not loaded (any more): nothing of the capability's, only a
// module that releases itself at once.
const RETIRE_ONLY = {
  compatibilityDate: "2025-01-01",
  mainModule: HOST_MAIN_MODULE,
  modules: {
    [HOST_MAIN_MODULE]: `import * as workers from "cloudflare:workers";
export const ${RETIRE_ENTRYPOINT} = { fetch() { workers.abortIsolate("retired"); } };
export default {};
`,
  },
};

// How many versions of one slot stay loaded: the one called last, and the one before it, for
// the calls still routed to it while a deploy switches over. Older ones are retired.
const VERSIONS_KEPT = 2;
// Slot → the cache ids loaded for it in this process, least recently called first.
const loadedBySlot = new Map();

// Note a call (or a start check) of `cacheId`; returns the ids of the slot to retire.
function touch(slot, cacheId) {
  const ids = (loadedBySlot.get(slot) || []).filter((id) => id !== cacheId);
  ids.push(cacheId);
  loadedBySlot.set(slot, ids);
  return ids.splice(0, Math.max(0, ids.length - VERSIONS_KEPT));
}

// Forget the slot's cache ids for `loaderId` (retried ones too); returns them.
function forget(slot, loaderId) {
  const ids = loadedBySlot.get(slot) || [];
  const kept = ids.filter((id) => id !== loaderId && !id.startsWith(`${loaderId}#`));
  if (kept.length) loadedBySlot.set(slot, kept);
  else loadedBySlot.delete(slot);
  return ids.filter((id) => !kept.includes(id));
}

// Calls already running in a retired isolate finish; the next call of its id loads it afresh,
// under a new name.
async function retire(env, cacheIds) {
  for (const id of cacheIds) {
    nextIncarnation(id.split("#")[0]);
    secretsByCacheId.delete(id);
    try {
      await env.LOADER.get(id, () => RETIRE_ONLY).getEntrypoint(RETIRE_ENTRYPOINT).fetch("http://retire/");
    } catch {
      // abortIsolate() ends the call with an error; code that failed to load throws its error.
    }
  }
}

// Start the code without calling any of its handlers: the Worker is asked for an entrypoint
// no capability has, which workerd looks up only once the top-level code has run.
async function started(worker, codeWasMissing, env) {
  try {
    await worker.getEntrypoint(PROBE_ENTRYPOINT).fetch("http://validate/");
  } catch (error) {
    const message = String((error && error.message) || error);
    if (codeWasMissing()) throw error;
    if (message.includes(PROBE_ENTRYPOINT)) return new Response(null, { status: 204 });
    if (message.startsWith("Failed to start Worker")) {
      return refuse(400, "invalid-code", message.replace(/^Failed to start Worker:\s*/, ""), env);
    }
    throw error;
  }
  return refuse(500, "exception", `the code answered as ${PROBE_ENTRYPOINT}`, env);
}

// Loader cache ids whose isolate has sent a tail event: the first call of each is the cold one.
const tailed = new Set();
const LEVELS = new Set(["debug", "info", "log", "warn", "error"]);

function logText(parts) {
  return (Array.isArray(parts) ? parts : [parts])
    .map((part) => {
      if (typeof part === "string") return part;
      try {
        return JSON.stringify(part) ?? String(part);
      } catch {
        return String(part);
      }
    })
    .join(" ");
}

// The secrets each loaded isolate was given (loader cache id → {NAME: value}), so that what the
// host says of its failures names a secret rather than showing it: that message becomes the
// caller's answer, Sigil's failure record, an async call's result, all of which are written
// down. Memory only, as the isolate itself holds them.
const secretsByCacheId = new Map();

// The secrets of the isolate `cacheId` (of the code `sha`), sorted longest first for masked();
// read again from the bundle when this host did not load it (a host restarted meanwhile).
async function secretsOf(env, sha, cacheId) {
  let secrets = secretsByCacheId.get(cacheId);
  if (!secrets) {
    try {
      const bundle = await readBundle(env, sha);
      secrets = bundle.sealed ? await unseal(bundle.sealed, env.SIGIL_SECRET, sha) : {};
    } catch {
      secrets = {};
    }
  }
  return Object.entries(secrets).sort((a, b) => b[1].length - a[1].length);
}

// Secrets first, cuts after, so that a cut never leaves part of a value behind.
function masked(text, secrets) {
  let out = String(text ?? "");
  for (const [name, value] of secrets) if (value) out = out.split(value).join(`[secret ${name}]`);
  return out;
}

function cut(text, maxBytes) {
  const bytes = new TextEncoder().encode(text);
  if (bytes.byteLength <= maxBytes) return [text, false];
  // Decoding a prefix may end in half a character: the replacement character marks it.
  return [new TextDecoder().decode(bytes.subarray(0, maxBytes)), true];
}

// A call's wall and CPU time in ms. Cloudflare's trace gives both (wallTime, cpuTime), and so
// does its emulator. Open-source workerd gives 0 for both, so where the host runs on it (the
// local runtime, which has LOG_SINK) `tailedAt` is the time the call's events reached the
// tail, which workerd hands them once the call is over: the wall time is measured from the
// call's start (eventTimestamp) to then, and the CPU time, which nothing here can measure, is
// null, "not given by this runtime", never a 0 that reads as a call that took no time.
function timesOf(event, tailedAt) {
  if (tailedAt === undefined) return { wall_ms: event.wallTime ?? null, cpu_ms: event.cpuTime ?? null };
  const wall = typeof event.eventTimestamp === "number" ? Math.max(0, tailedAt - event.eventTimestamp) : null;
  return { wall_ms: wall, cpu_ms: null };
}

// One tail event as a call's record, or null for the host's own calls into the isolate (the
// start check, a retire), which carry no request id. `props`: the slot, the code's sha, the
// loader cache id (whose first event is the cold call; none: not known) and the secrets.
// `tailedAt`: where the runtime gives no times, when the event reached the tail (timesOf).
export function callRecord(event, props, limits, tailedAt) {
  const request = event.event && event.event.request;
  const requestId = request && request.headers && request.headers["x-request-id"];
  if (!requestId) return null;
  const secrets = Object.entries(props.secrets || {}).sort((a, b) => b[1].length - a[1].length);
  const logs = [];
  let linesCut = 0;
  let bytesCut = 0;
  for (const entry of event.logs || []) {
    if (logs.length >= limits.lines) {
      linesCut += 1;
      continue;
    }
    const [text, wasCut] = cut(masked(logText(entry.message), secrets), limits.lineBytes);
    if (wasCut) bytesCut += 1;
    logs.push({ level: LEVELS.has(entry.level) ? entry.level : "log", at: entry.timestamp / 1000, text, cut: wasCut });
  }
  const thrown = (event.exceptions || [])[0];
  let exception = null;
  if (thrown) {
    exception = {
      name: cut(masked(thrown.name, secrets), limits.lineBytes)[0],
      message: cut(masked(thrown.message, secrets), limits.lineBytes)[0],
      stack: cut(masked(thrown.stack, secrets), limits.lineBytes * 4)[0],
    };
  }
  const cold = props.cacheId ? !tailed.has(props.cacheId) : null;
  if (props.cacheId) tailed.add(props.cacheId);
  const response = event.event.response;
  return {
    capability: props.slot,
    sha: props.sha,
    request_id: requestId,
    at: event.eventTimestamp / 1000,
    outcome: event.outcome,
    status: response && typeof response.status === "number" ? response.status : null,
    ...timesOf(event, tailedAt),
    cold,
    logs,
    lines_cut: linesCut,
    lines_shortened: bytesCut,
    exception,
    // workerd itself dropped some of the call's events (its own bound).
    runtime_truncated: Boolean(event.truncated),
  };
}

// The tail events of calls, as records queued for the channel's next batch (channel.js).
// `propsOf(event)` gives each event's props (callRecord).
export async function tailEvents(events, env, propsOf) {
  // On the local runtime (LOG_SINK) workerd gives no times: the host measures the wall time.
  const tailedAt = env.LOG_SINK ? Date.now() : undefined;
  const limits = channelLimits(env);
  for (const event of events) {
    const record = callRecord(event, propsOf(event), limits, tailedAt);
    if (record) queueRecord(record);
  }
  await deliver(env, limits);
}

export class SigilTail extends WorkerEntrypoint {
  async tail(events) {
    const props = this.ctx.props || {};
    await tailEvents(events, this.env, () => props);
  }
}

export default {
  async fetch(request, env, ctx) {
    if (env.SIGIL_EDGE === "true" && !request.headers.has(SECRET_HEADER)) {
      // A caller's request (the loader runtime's Worker with the edge on): the edge serves it
      // (edge.js, uploaded beside this module), reaching a capability as Sigil does, through here.
      const edge = await import("./edge.js");
      const runner = {
        marker: HOST_HEADER,
        reach: (route, call, cpuMs) => {
          const headers = new Headers(call.headers);
          headers.set(SECRET_HEADER, env.SIGIL_SECRET);
          headers.set(LOADER_ID_HEADER, `${route.slot}@${route.sha}`);
          if (cpuMs > 0) headers.set(CPU_HEADER, String(cpuMs));
          return this.fetch(new Request(call, { headers }), env, ctx);
        },
      };
      return edge.serveEdge(request, env, ctx, runner);
    }
    if (!sameSecret(request.headers.get(SECRET_HEADER), env.SIGIL_SECRET)) {
      return refuse(403, "forbidden", "this host answers only to Sigil", env);
    }
    const loaderId = request.headers.get(LOADER_ID_HEADER) || "";
    if (!LOADER_ID.test(loaderId)) {
      return refuse(400, "bad-loader-id", `malformed loader id ${JSON.stringify(loaderId)}`);
    }
    const slot = loaderId.slice(0, loaderId.indexOf("@"));
    const sha = loaderId.slice(loaderId.indexOf("@") + 1);
    if (request.headers.get(RETIRE_HEADER) === "1") {
      await retire(env, forget(slot, loaderId));
      return new Response(null, { status: 204 });
    }
    if (request.headers.get(STORE_HEADER) === "1") {
      // Workers KV caches a read that found nothing where it was made (up to 60 s), even once
      // Sigil's API write of the bundle arrives there; a write through the binding is seen
      // where it was made at once. So Sigil stores a bundle through the host when the host's
      // start check did not find it (capabilities/runtimes/loader.py).
      if (!env.CODE_KV) return refuse(400, "no-kv", "this host reads no code from Workers KV", env);
      await env.CODE_KV.put(`code:${sha}`, await request.text());
      return new Response(null, { status: 204 });
    }

    const cpuMs = Number.parseInt(request.headers.get(CPU_HEADER) || "", 10);
    const headers = new Headers(request.headers);
    headers.delete(SECRET_HEADER);
    headers.delete(LOADER_ID_HEADER);
    headers.delete(CPU_HEADER);
    const forwarded = new Request(request, { headers });

    let missing = false;
    const cacheId = cacheIdOf(loaderId);
    // Awaited, so that once a new version has been started (its start check), the one two
    // versions back is gone; it is one short call, made once per version.
    await retire(env, touch(slot, cacheId));
    // Call records are on where the host has the local log sink, or on Cloudflare a spool for
    // them (LOG_KV): SIGIL_RECORDS_URL alone is the edge's, whose reports travel without them.
    const logged = Boolean((env.LOG_SINK || (env.SIGIL_RECORDS_URL && env.LOG_KV)) && ctx && ctx.exports && ctx.exports.SigilTail);
    const worker = env.LOADER.get(cacheId, async () => {
      let bundle, secrets;
      try {
        bundle = await readBundle(env, sha);
        secrets = bundle.sealed ? await unseal(bundle.sealed, env.SIGIL_SECRET, sha) : {};
      } catch (error) {
        if (error instanceof MissingCode) missing = true;
        throw error;
      }
      secretsByCacheId.set(cacheId, secrets);
      return {
        compatibilityDate: bundle.compatibilityDate || "2025-01-01",
        compatibilityFlags: bundle.compatibilityFlags || [],
        mainModule: HOST_MAIN_MODULE,
        modules: {
          ...bundle.modules,
          [HOST_MAIN_MODULE]: hostMainModule(bundle.mainModule),
          [CONSOLE_MODULE]: consoleModule(secrets),
        },
        env: { ...bundle.env, ...secrets },
        // Capabilities may call out to the network as Workers do on Cloudflare.
        tails: logged ? [ctx.exports.SigilTail({ props: { slot, sha, cacheId, secrets } })] : [],
      };
    });
    try {
      if (request.headers.get(VALIDATE_HEADER) === "1") {
        const answer = await started(worker, () => missing, env);
        return answer.status === 400 ? maskedRefusal(answer, await secretsOf(env, sha, cacheId)) : answer;
      }
      // Cloudflare enforces the limit; open-source workerd accepts it and does not (reference §5.3).
      const entrypoint = cpuMs > 0 ? worker.getEntrypoint(null, { limits: { cpuMs } }) : worker.getEntrypoint();
      const response = await entrypoint.fetch(forwarded);
      // Marked (Sigil's gateway removes it) so that a 404 without the mark is known not to
      // come from a capability: on Cloudflare, the host Worker itself is not there.
      const marked = new Response(response.body, response);
      marked.headers.set(HOST_HEADER, "ok");
      return marked;
    } catch (error) {
      if (missing) {
        nextIncarnation(loaderId);
        return refuse(404, "missing-code", String(error && error.message));
      }
      // Cloudflare stops a Dynamic Worker past its limit with this exception (reference §5.3).
      const message = String((error && error.message) || error);
      if (message.includes("CPU time limit")) {
        return refuse(500, "exceeded-cpu", `ran past its CPU limit${cpuMs > 0 ? ` of ${cpuMs} ms` : ""}`, env);
      }
      const secrets = await secretsOf(env, sha, cacheId);
      // What workerd throws when the runtime itself failed the call: not the capability's doing.
      if (message.startsWith("internal error")) return refuse(502, "internal-error", masked(message, secrets), env);
      return refuse(500, "exception", masked(String((error && error.stack) || error), secrets));
    }
  },
};
