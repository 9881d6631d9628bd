// The edge: a caller's call served in Sigil's own Worker on Cloudflare, with no round trip to
// Sigil's server (the origin) when what Sigil published in Workers KV says how.
//
// Uploaded beside each Cloudflare runtime's Worker of Sigil's (the platform's dispatch
// Worker, the loader's loader Worker, the worker-pool's sigil-edge Worker), which hands it a
// caller's request (one without Sigil's internal secret header) and a runner: how that
// runtime reaches a slot (`reach(route, request, cpuMs)`, which answers as the runtime answers
// Sigil's engine: marked with `marker`, or refused with `x-sigil-error`; or null when it cannot
// from here), so the edge reads its answers as capabilities/engine/sending.py does.
//
// It makes the engine's decisions in the engine's order (capabilities/engine/engine.py
// handle/serve/forward, admission.py), in the contract's envelope and words (sigil/errors.py):
// the names; the token (`tok:{sha256}` = agents/tokens.py:encode, `-` revoked or expired,
// `-disabled`); Prefer: respond-async; the route (`route:{full}` = capabilities/books/routes.py:encode
// plus `brk`, the breaker: null closed, "forced", or the epoch its cool-down ends at); a split's
// share (the engine's bucket: crc32 of "{variant}|{caller}" mod 100); the breaker; the state;
// the body limit; then the capability, whose answer passes on as it arrives with the headers the
// engine adds (capabilities/engine/answers.py:call_headers). A key it does not find, a half-open
// breaker, a capability not live, a degraded one whose owner keeps a cache of its answers, a
// path that is not a call, or anything else it cannot decide goes to the origin as the caller
// sent it, with a signed mark (x-sigil-edge) naming the caller's address: the origin serves
// it as any call. So a capability deployed a second ago, or a token issued a second ago, works
// at once, through the origin, until its keys are published.
//
// What the edge reads of KV it keeps MEMO_MS in this isolate, so a hot call does not await KV
// each time: a change published to KV reaches the edge at most that much later than KV itself
// delivers it (Workers KV's own cache, up to 60 s at a location that read the key before).
//
// The failed-token brake (agents/throttle.py) and an agent's shares of a server are the
// origin's: a token the edge does not know goes there, so guesses still meet the brake.
//
// Each call the edge answers itself it reports to the origin (report), which records it as the
// engine records its own: counters, breaker, failure record, token last-use, pager access, the
// access log. Reports travel by the call records' report channel (channel.js, uploaded beside
// this module): a failure at once, so that the origin's breaker counts it, the rest batched.

import { channelLimits, deliver, queueReport } from "./channel.js";

const MEMO_MS = 1000;
const MEMO_KEPT = 4096;
// The engine's answers to a request it cannot serve itself, and the markers of Sigil's Workers.
const ERROR_HEADER = "x-sigil-error";
// capabilities/engine/sending.py: the longest wait a runtime's Retry-After is passed on with.
const MAX_RUNTIME_RETRY_AFTER_SECONDS = 300;
const SERVED_VERSION_HEADER = "x-sigil-served-version";
const EDGE_MARK = "x-sigil-edge";
// RFC 9110 §7.6.1 connection-specific fields (capabilities/engine/upstream.py:HOP_BY_HOP).
const HOP_BY_HOP = new Set([
  "connection",
  "keep-alive",
  "proxy-authenticate",
  "proxy-authorization",
  "te",
  "trailer",
  "transfer-encoding",
  "upgrade",
]);
// What a capability never gets of the caller's request besides those (sending.py).
const DROPPED_REQUEST_HEADERS = new Set([...HOP_BY_HOP, "authorization", "content-length"]);
// The paths Sigil's server serves itself, never a call (sigil_site/asgi.py: DJANGO_PREFIXES, MCP_PATH).
const SITE_PREFIXES = ["/_", "/admin/", "/admin", "/static/", "/metrics", "/favicon.ico", "/llms.txt"];
// agents/names.py and capabilities/names.py.
const AGENT_NAME = /^[a-z][a-z0-9-]{0,30}$/;
const RESERVED_AGENT_NAMES = new Set(["admin", "static", "metrics"]);
const CAPABILITY_NAME = /^[a-z0-9][a-z0-9-]{0,40}$/;
const SEPARATOR = "--";
// What re-quoting a call's path keeps as it is (capabilities/engine/adapter.py: PATH_SAFE), and
// what Python's quote() keeps of a name in a refusal.
const PATH_SAFE = /[A-Za-z0-9/:@!$&'()*+,;=\-._~]/;
const NAME_SAFE = /[A-Za-z0-9/_.\-~]/;
// agents/tokens.py and capabilities/books/routes.py.
const TOMBSTONE = "-";
const DISABLED = "-disabled";
const SERVED_STATES = new Set(["live", "evicting"]);
const FORCED = "forced";
// agents/selectors.py: the refusals of a token, word for word.
const SEND_BEARER = "send Authorization: Bearer <token>";
const TOKEN_REFUSED = "the token is unknown, revoked or expired: ask the owner for a new one";
const AGENT_DISABLED = "the owner disabled this token's agent: its tokens work again once the owner enables it";
// capabilities/engine/answers.py: STATUS_TEXT.
const STATUS_TEXT = {
  401: "Unauthorized",
  404: "Not Found",
  413: "Content Too Large",
  500: "Internal Server Error",
  502: "Bad Gateway",
  503: "Service Unavailable",
  504: "Gateway Timeout",
};
// sigil/errors.py: UNAVAILABLE_RETRY_SECONDS.
const UNAVAILABLE_RETRY_SECONDS = 5;
const WWW_AUTHENTICATE = 'Bearer realm="sigil"';

// Answered by the decisions below when the origin is to serve the call.
const ORIGIN = Symbol("origin");

/** An answer of Sigil's own, in the envelope of docs/errors.md (sigil/errors.py's classes). */
class Refusal extends Error {
  constructor(status, code, message, { retryAfter = null, failure = null } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
    this.failure = failure; // what the failure record says, when not the message (what a capability threw)
  }
}

const notFound = (message) => new Refusal(404, "not_found", message);
const unauthenticated = (message) => new Refusal(401, "unauthenticated", message);

/**
 * Serve one caller's request at the edge: the capability's answer, Sigil's refusal, or the
 * origin's answer. `runner` is the runtime's way to a slot (see the module's comment).
 */
export async function serveEdge(request, env, ctx, runner) {
  const call = {
    started: Date.now(),
    requestId: newRequestId(),
    capability: null, // the full name a refusal or an answer is counted on
    shown: null,
    caller: null,
    owner: null,
    tokenHash: null,
    version: null,
    type: null,
    capabilityMs: null,
  };
  let answer;
  let refusal = null;
  try {
    answer = await serve(request, env, runner, call);
  } catch (error) {
    refusal = error instanceof Refusal ? error : unexpected(error, call);
    answer = errorAnswer(refusal);
  }
  if (answer === ORIGIN) return toOrigin(request, env);
  answer.headers.set("X-Request-Id", call.requestId);
  const answeredAt = Date.now();
  let failureLine = Promise.resolve("");
  if (refusal === null && answer.status >= 500 && answer.body !== null) {
    // The capability's own 5xx: its failure record holds the first line of its body.
    const [passed, read] = answer.body.tee();
    answer = new Response(passed, { status: answer.status, statusText: answer.statusText, headers: answer.headers });
    failureLine = firstLine(read);
  }
  const status = answer.status;
  const reported = failureLine.then((line) => report(callReport(request, call, answeredAt, status, refusal, line), env));
  if (ctx && ctx.waitUntil) ctx.waitUntil(reported.catch((error) => console.error(`a call's report was lost: ${error}`)));
  return answer;
}

// --- what the edge reports of the calls it answered ------------------------------------------

// The refusals that are the capability's own failure, counted as its call and toward its
// breaker (capabilities/engine/sending.py: what Recorder.finish records, CapabilityError and
// Timeout); any other refusal is counted as an answer Sigil gave (stats.answer_count).
const CALL_FAILURES = new Set(["capability_error", "timeout"]);
// capabilities/books/failures.py: MESSAGE_MAX_CHARS.
const FAILURE_MESSAGE_CHARS = 500;

/**
 * Each call the edge answered itself, served or refused, as one report once its answer's head
 * is known (a streamed body may still be on its way). The origin applies it as the engine
 * records a call of its own (capabilities/services/edge_reports.py): the counters, the breaker's
 * outcome, the failure record, the token's last use and the pager's access time of a call that
 * reached the capability's code, the count of an answer Sigil gave, and the access log's line.
 * It travels by the report channel (channel.js), a failure at once, the rest in the next batch.
 */
export function report(item, env) {
  if (!env.SIGIL_RECORDS_URL) return Promise.resolve(); // uploaded without an origin to report to
  queueReport(item);
  return deliver(env, channelLimits(env), { urgent: item.call && !item.ok });
}

/** The report of one call: what capabilities/services/edge_reports.py:EdgeReport reads. */
function callReport(request, call, answeredAt, status, refusal, failureLine) {
  const reached = refusal === null || CALL_FAILURES.has(refusal.code);
  const ok = refusal === null && status < 500;
  let message = "";
  if (reached && !ok) message = refusal === null ? failureLine : (refusal.failure ?? refusal.message);
  return {
    rid: call.requestId,
    at: answeredAt / 1000,
    method: request.method,
    path: new URL(request.url).pathname.slice(0, 2048),
    capability: call.capability,
    type: reached ? call.type : null,
    token: reached ? call.tokenHash : null,
    version: call.version,
    status,
    code: refusal === null ? null : refusal.code,
    ms: answeredAt - call.started,
    call: reached,
    ok,
    message: message.slice(0, FAILURE_MESSAGE_CHARS),
  };
}

/** The first line of a body's first chunk (capabilities/engine/recording.py:_first_line); the rest is let go. */
async function firstLine(body) {
  const reader = body.getReader();
  try {
    const { value } = await reader.read();
    if (!value) return "";
    const text = new TextDecoder().decode(value.subarray(0, FAILURE_MESSAGE_CHARS)).trim();
    return text.split(/\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]/)[0] || "";
  } catch {
    return "";
  } finally {
    reader.cancel().catch(() => {});
  }
}

async function serve(request, env, runner, call) {
  const url = new URL(request.url);
  const decoded = unquote(url.pathname);
  if (decoded === "/" || decoded === "/_mcp" || SITE_PREFIXES.some((prefix) => decoded.startsWith(prefix))) {
    return ORIGIN; // the site, the API, MCP: the origin's
  }
  const websocket = (request.headers.get("upgrade") || "").toLowerCase() === "websocket";
  const [agent, name, rest] = callPath(url.pathname);
  if (!validAgent(agent) || !validCapability(name)) {
    throw notFound(`no capability at ${quote(`/${agent}/${name}`, NAME_SAFE)}`);
  }
  const secret = bearer(request.headers.get("authorization"));
  const tokenHash = await sha256Hex(secret);
  let full = `${agent}${SEPARATOR}${name}`;
  let tokenRaw, routeRaw;
  try {
    [tokenRaw, routeRaw] = await Promise.all([read(env, `tok:${tokenHash}`), read(env, `route:${full}`)]);
  } catch (error) {
    console.error(`the edge could not read Workers KV, so the origin serves the call: ${error}`);
    return ORIGIN;
  }
  const route0 = routeRaw !== null && routeRaw !== TOMBSTONE ? decodeRoute(routeRaw) : null;
  if (route0 !== null) call.capability = full;

  // The token.
  if (tokenRaw === null) return ORIGIN; // issued since the last publication, or never: the origin knows
  if (tokenRaw === TOMBSTONE) throw unauthenticated(TOKEN_REFUSED);
  if (tokenRaw === DISABLED) throw unauthenticated(AGENT_DISABLED);
  const principal = decodeToken(tokenRaw);
  if (principal === null) return ORIGIN;
  if (principal.expires !== null && principal.expires <= Date.now() / 1000) throw unauthenticated(TOKEN_REFUSED);
  call.caller = principal.agent;
  call.tokenHash = tokenHash;
  if (!websocket && (request.headers.get("prefer") || "").includes("respond-async")) return ORIGIN;

  // The route, as the caller may see it.
  if (routeRaw === null) return ORIGIN;
  if (routeRaw === TOMBSTONE) throw notFound(`no capability ${full}`);
  if (route0 === null) return ORIGIN; // not a route this edge can read
  let route = route0;
  if (!(route.agent === principal.agent || route.public)) throw notFound(`no capability ${full}`);
  if (route.exp !== null && route.exp !== undefined && route.exp <= Date.now() / 1000) {
    throw notFound(`${full} has expired`);
  }
  call.shown = full;
  call.owner = route.agent;
  if (Array.isArray(route.split) && route.split.length === 3) {
    const [variant, weight, header] = route.split;
    const key = (header && request.headers.get(header)) || tokenHash;
    if (crc32(`${variant}|${key}`) % 100 < weight) {
      const variantRaw = await read(env, `route:${variant}`);
      if (variantRaw === null) return ORIGIN;
      const staged = variantRaw === TOMBSTONE ? null : decodeRoute(variantRaw);
      if (variantRaw !== TOMBSTONE && staged === null) return ORIGIN;
      if (staged !== null) {
        // The split's staged version answers this caller; a tombstone: the split just ended.
        full = variant;
        route = staged;
        call.capability = full;
      }
    }
  }

  // The breaker.
  const now = Date.now() / 1000;
  const breaker = route.brk ?? null;
  if (breaker !== null) {
    const open = breaker === FORCED || (typeof breaker === "number" && breaker > now);
    if (!open) return ORIGIN; // half-open: the origin runs its one trial call
    if (route.cache && request.method === "GET") return ORIGIN; // the degraded cache is the origin's
    const cooldown = Number(env.SIGIL_BREAKER_COOLDOWN_SECONDS || 30);
    if (breaker === FORCED) {
      throw new Refusal(503, "degraded", `${full} was made degraded by Sigil's owner`, { retryAfter: cooldown });
    }
    throw new Refusal(503, "degraded", `${full} is degraded after repeated failures`, { retryAfter: breaker - now });
  }

  // Where it runs: only a live placement on this edge's runtime (else the origin pages it in).
  if (!SERVED_STATES.has(route.state)) return ORIGIN;
  if (route.backend && env.SIGIL_BACKEND && route.backend !== env.SIGIL_BACKEND) return ORIGIN;
  call.version = route.ver ?? null;
  call.type = route.type ?? null;

  // The body.
  const maxBody = Number(env.SIGIL_INVOKE_MAX_BODY_BYTES || 100 * 1024 * 1024);
  const length = request.headers.get("content-length");
  const size = length === null ? null : Number(length);
  const chunked = request.body !== null && length === null;
  const hasBody = (size !== null && size > 0) || chunked;
  if (size !== null && size > maxBody) throw new Refusal(413, "too_large", `the request body is over ${maxBody} bytes`);

  return forward(request, env, runner, call, { route, full, rest, url, websocket, hasBody, chunked, maxBody });
}

async function forward(request, env, runner, call, { route, full, rest, url, websocket, hasBody, chunked, maxBody }) {
  const headers = new Headers();
  for (const [name, value] of request.headers) {
    if (name.startsWith("x-sigil-")) continue;
    if (DROPPED_REQUEST_HEADERS.has(name) && !(websocket && (name === "upgrade" || name === "connection"))) continue;
    headers.append(name, value);
  }
  headers.set("x-request-id", call.requestId); // Sigil's, never the caller's
  const tooLarge = { tripped: false };
  let body = null;
  if (hasBody) body = chunked ? limited(request.body, maxBody, tooLarge) : request.body;
  // Joined as text: a rest like "//host/x" stays a path, as the engine sends it.
  const target = new URL(url.origin + rest + url.search);
  const sent = new Request(target, { method: request.method, headers, body, redirect: "manual" });
  const cpuMs = Number(route.cpu || env.SIGIL_CPU_MS || 0);
  const timeoutSeconds = Number(env.SIGIL_INVOKE_TIMEOUT_SECONDS || 30);

  const sentAt = Date.now();
  let response;
  let timer;
  try {
    const reached = runner.reach(route, sent, cpuMs);
    const timedOut = new Promise((resolve) => {
      timer = setTimeout(() => resolve(ORIGIN), timeoutSeconds * 1000);
    });
    response = await Promise.race([reached, timedOut]);
    if (response === ORIGIN) throw new Refusal(504, "timeout", `${full} did not answer within ${timeoutSeconds} s`);
  } catch (error) {
    if (tooLarge.tripped) throw new Refusal(413, "too_large", `the request body is over ${maxBody} bytes`);
    if (error instanceof Refusal) throw error;
    throw new Refusal(502, "upstream_error", `the runtime could not be reached for ${full}: ${error}`);
  } finally {
    clearTimeout(timer);
  }
  if (response === null) return ORIGIN; // the runtime cannot reach it from here (the pool's redirects)
  if (tooLarge.tripped) {
    // The body was cut past the limit: the capability saw it end early, and its answer is not the caller's.
    if (response.body) response.body.cancel().catch(() => {});
    throw new Refusal(413, "too_large", `the request body is over ${maxBody} bytes`);
  }
  call.capabilityMs = Date.now() - sentAt;

  const failureHeader = response.headers.get(ERROR_HEADER);
  const marked = response.headers.has(runner.marker);
  if (response.status === 404 && (failureHeader === "missing-code" || !marked) && !hasBody) {
    // The runtime lost its script: the origin places it again (a body could not be sent twice).
    if (response.body) response.body.cancel().catch(() => {});
    return ORIGIN;
  }
  const served = response.headers.get(SERVED_VERSION_HEADER);
  if (served !== null && /^[0-9]+$/.test(served)) call.version = Number(served);
  let failure = failureHeader;
  // An unmarked 5xx is Cloudflare's own: its stop at the capability's limits (1102's 503), or
  // its own side failing (engine.py, Runtime.stopped_at_limits and failed_itself).
  if (failure === null && response.status >= 500 && !marked) {
    failure = response.status === 503 ? "exceeded-limits" : "internal-error";
  }
  if (failure !== null) throw await runtimeFailure(response, failure, full);

  if (websocket && response.status !== 101) {
    // The capability answered the upgrade without taking it: the caller gets its status alone,
    // as the engine answers it (capabilities/engine/websocket.py: websocket_open).
    if (response.body) response.body.cancel().catch(() => {});
    return new Response(null, { status: response.status, headers: { "Content-Length": "0" } });
  }
  const answerHeaders = new Headers();
  for (const [name, value] of response.headers) {
    if (HOP_BY_HOP.has(name) || name.startsWith("x-sigil-")) continue;
    answerHeaders.append(name, value);
  }
  const upgraded = response.status === 101 && response.webSocket;
  // A session's 101 carries no Server-Timing: the call lasts as long as the session (websocket.py).
  for (const [name, value] of callHeaders(call, { timing: !upgraded })) answerHeaders.append(name, value);
  if (upgraded) {
    return new Response(null, { status: 101, webSocket: response.webSocket, headers: answerHeaders });
  }
  return new Response(response.body, { status: response.status, statusText: response.statusText, headers: answerHeaders });
}

/**
 * capabilities/engine/answers.py:call_headers, for an answer of the capability's; Server-Timing
 * only with `timing` (the engine's upstream_ms).
 */
function callHeaders(call, { timing = true } = {}) {
  const headers = [["X-Sigil-Capability", call.shown]];
  if (call.version !== null) headers.push(["X-Sigil-Version", String(call.version)]);
  if (!timing) return headers;
  const total = Date.now() - call.started;
  const sigilMs = total - call.capabilityMs;
  headers.push(["Server-Timing", `sigil;dur=${sigilMs.toFixed(2)}, capability;dur=${call.capabilityMs.toFixed(2)}`]);
  return headers;
}

/** capabilities/engine/sending.py:Sender.runtime_failure: the refusal for an answer the runtime marked as a failure. */
async function runtimeFailure(response, failure, full) {
  const text = (await response.text()).slice(0, 2000);
  if (failure === "exception") {
    let thrown;
    try {
      thrown = JSON.parse(text).message.split(/\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]/)[0].slice(0, 500);
    } catch {
      thrown = text.slice(0, 500);
    }
    return new Refusal(502, "capability_error", `${full} threw: ${thrown}`, { failure: thrown });
  }
  if (failure === "exceeded-cpu") {
    let what = "ran past its CPU limit";
    try {
      const message = JSON.parse(text).message;
      if (typeof message === "string") what = message.slice(0, 200);
    } catch {
      // the words above
    }
    return new Refusal(504, "timeout", `${full} ${what} and was stopped`);
  }
  if (failure === "internal-error") {
    // capabilities/engine/sending.py:runtime_failed_itself: the runtime's failure, not the capability's.
    const retry = (response.headers.get("retry-after") || "").trim();
    if (/^[0-9]+$/.test(retry)) {
      const seconds = Math.min(Math.max(Number(retry), 1), MAX_RUNTIME_RETRY_AFTER_SECONDS);
      return new Refusal(
        503,
        "unavailable",
        `the runtime failed to run ${full} on its own side (${response.status}); try again in ${seconds} s`,
        { retryAfter: seconds },
      );
    }
    return new Refusal(502, "upstream_error", `the runtime failed to run ${full} on its own side (${response.status})`);
  }
  if (failure === "exceeded-limits") {
    return new Refusal(502, "capability_error", `${full} ran past its resource limits (CPU time or memory) and was stopped`);
  }
  console.error(`runtime refused a call to ${full}: ${failure} ${text}`);
  return new Refusal(502, "upstream_error", `the runtime failed to run ${full} (${failure})`);
}

/** The caller's request as it came, to the origin, with the edge's signed mark. */
async function toOrigin(request, env) {
  const url = new URL(request.url);
  const origin = String(env.SIGIL_ORIGIN_URL || "").replace(/\/+$/, "");
  if (!origin || originHost(origin) === url.host) {
    // No origin, or one that is this Worker itself (a call would come back here until
    // Cloudflare's loop limit): Sigil's server cannot be reached from here.
    console.error(`SIGIL_ORIGIN_URL ${JSON.stringify(origin)} is no origin this edge can hand calls to`);
    return unreachable();
  }
  const headers = new Headers(request.headers);
  for (const name of [...headers.keys()]) if (name.startsWith(EDGE_MARK)) headers.delete(name);
  headers.delete("host");
  for (const [name, value] of await edgeMark(env, request.method, url.pathname, request.headers.get("cf-connecting-ip") || "")) {
    headers.set(name, value);
  }
  try {
    return await fetch(origin + url.pathname + url.search, {
      method: request.method,
      headers,
      body: request.body,
      redirect: "manual",
    });
  } catch (error) {
    console.error(`the origin ${origin} could not be reached: ${error}`);
    return unreachable();
  }
}

/** The answer to a call the edge had to hand the origin and could not. */
function unreachable() {
  const refusal = new Refusal(503, "unavailable", "Sigil's server could not be reached; try again shortly", {
    retryAfter: UNAVAILABLE_RETRY_SECONDS,
  });
  const answer = errorAnswer(refusal);
  answer.headers.set("X-Request-Id", newRequestId());
  return answer;
}

function originHost(origin) {
  try {
    return new URL(origin).host;
  } catch {
    return "";
  }
}

/**
 * The mark on a call the edge hands the origin: the caller's address (Cloudflare's
 * CF-Connecting-IP), when, and an HMAC-SHA256 of "{when}.{address}\n{method}\n{path}" under
 * the edge's key, as the Workers sign their pushes (sigil/edge_handoff.py checks it), so that the
 * origin may trust the address.
 */
export async function edgeMark(env, method, path, client) {
  const at = String(Math.floor(Date.now() / 1000));
  const signature = await hmacHex(env.SIGIL_EDGE_KEY || "", `${at}.${client}\n${method}\n${path}`);
  return [
    [EDGE_MARK, "1"],
    [`${EDGE_MARK}-client`, client],
    [`${EDGE_MARK}-at`, at],
    [`${EDGE_MARK}-signature`, signature],
  ];
}

// --- what the edge reads ------------------------------------------------------------------

const memo = new Map();

async function read(env, key) {
  const now = Date.now();
  const held = memo.get(key);
  if (held !== undefined && held.until > now) return held.value;
  const value = await env.EDGE_KV.get(key);
  if (memo.size >= MEMO_KEPT) memo.clear();
  memo.set(key, { value, until: now + MEMO_MS });
  return value;
}

/** agents/tokens.py:decode: `id|agent|scope|expires|calls|placements`, or null when unreadable. */
function decodeToken(raw) {
  const parts = raw.split("|");
  if (parts.length < 4) return null;
  const expires = parts[3] === "" ? null : Number(parts[3]);
  if (expires !== null && Number.isNaN(expires)) return null;
  return { id: Number(parts[0]), agent: parts[1], scope: parts[2], expires };
}

const decodedRoutes = new Map();

/** capabilities/books/routes.py:decode with `brk`; null when it is not a route document. */
function decodeRoute(raw) {
  let route = decodedRoutes.get(raw);
  if (route === undefined) {
    try {
      route = JSON.parse(raw);
    } catch {
      route = null;
    }
    if (route !== null && (typeof route !== "object" || typeof route.agent !== "string" || typeof route.slot !== "string")) {
      route = null;
    }
    if (decodedRoutes.size >= MEMO_KEPT) decodedRoutes.clear();
    decodedRoutes.set(raw, route);
  }
  return route;
}

// --- names and paths, as the ASGI entry and the engine parse them ----------------------------

/** sigil_site/asgi.py + adapter.py: agent, name (unquoted) and the rest of the path (re-quoted). */
function callPath(pathname) {
  const path = pathname.replace(/^\/+/, "");
  const slash = path.indexOf("/");
  const agent = slash < 0 ? path : path.slice(0, slash);
  const tail = slash < 0 ? "" : path.slice(slash + 1);
  const second = tail.indexOf("/");
  const name = second < 0 ? tail : tail.slice(0, second);
  const rest = second < 0 ? "/" : "/" + quoteBytes(unquoteToBytes(tail.slice(second + 1)), PATH_SAFE);
  return [unquote(agent), unquote(name), rest];
}

function validAgent(name) {
  return AGENT_NAME.test(name) && !name.includes(SEPARATOR) && !RESERVED_AGENT_NAMES.has(name);
}

function validCapability(name) {
  return CAPABILITY_NAME.test(name) && !name.includes(SEPARATOR);
}

/** agents/selectors.py:parse_bearer. */
function bearer(header) {
  if (!header) throw unauthenticated(SEND_BEARER);
  const space = header.indexOf(" ");
  const scheme = space < 0 ? header : header.slice(0, space);
  const secret = space < 0 ? "" : header.slice(space + 1);
  if (scheme.toLowerCase() !== "bearer" || !secret.trim()) throw unauthenticated(SEND_BEARER);
  return secret.trim();
}

const encoder = new TextEncoder();

/** Python's unquote_to_bytes: each valid %XX a byte, everything else its UTF-8. */
function unquoteToBytes(text) {
  const bytes = [];
  for (let i = 0; i < text.length; ) {
    if (text[i] === "%" && /^[0-9A-Fa-f]{2}$/.test(text.slice(i + 1, i + 3))) {
      bytes.push(Number.parseInt(text.slice(i + 1, i + 3), 16));
      i += 3;
      continue;
    }
    const char = String.fromCodePoint(text.codePointAt(i));
    bytes.push(...encoder.encode(char));
    i += char.length;
  }
  return new Uint8Array(bytes);
}

/** Python's unquote: decoded as UTF-8, a bad sequence replaced. */
function unquote(text) {
  return text.includes("%") ? new TextDecoder().decode(unquoteToBytes(text)) : text;
}

/** Python's quote of `bytes`, keeping what `safe` matches. */
function quoteBytes(bytes, safe) {
  let out = "";
  for (const byte of bytes) {
    const char = String.fromCharCode(byte);
    out += byte < 128 && safe.test(char) ? char : `%${byte.toString(16).toUpperCase().padStart(2, "0")}`;
  }
  return out;
}

function quote(text, safe) {
  return quoteBytes(encoder.encode(text), safe);
}

// --- Sigil's own answers ---------------------------------------------------------------------

/** capabilities/engine/answers.py:error_answer, the body as Python's json.dumps writes it. */
function errorAnswer(refusal) {
  const body = `{"error": {"code": ${pythonJson(refusal.code)}, "message": ${pythonJson(refusal.message)}}}`;
  const headers = new Headers({
    "Content-Type": "application/json",
    "Content-Length": String(encoder.encode(body).byteLength),
    "X-Content-Type-Options": "nosniff",
  });
  if (refusal.retryAfter !== null) headers.set("Retry-After", String(Math.max(1, Math.ceil(refusal.retryAfter))));
  if (refusal.status === 401) headers.set("WWW-Authenticate", WWW_AUTHENTICATE);
  return new Response(body, { status: refusal.status, statusText: STATUS_TEXT[refusal.status] || "", headers });
}

/** A JSON string as Python's json.dumps writes one (ensure_ascii: \uXXXX past ASCII). */
function pythonJson(text) {
  return JSON.stringify(String(text)).replace(
    /[^\x20-\x7e]/g,
    (char) => `\\u${char.charCodeAt(0).toString(16).padStart(4, "0")}`,
  );
}

function unexpected(error, call) {
  console.error(`request ${call.requestId} failed at the edge: ${(error && error.stack) || error}`);
  return new Refusal(500, "internal_error", `Sigil failed unexpectedly; the error was logged as request ${call.requestId}`);
}

// --- small parts -----------------------------------------------------------------------------

/** A chunked body passed on as it arrives, cut past `max` bytes (sending.py:limited_body). */
function limited(body, max, tooLarge) {
  let size = 0;
  return body.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        size += chunk.byteLength;
        if (size > max) {
          tooLarge.tripped = true;
          controller.error(new Error(`the request body is over ${max} bytes`));
          return;
        }
        controller.enqueue(chunk);
      },
    }),
  );
}

function newRequestId() {
  return hex(crypto.getRandomValues(new Uint8Array(8)));
}

function hex(bytes) {
  return [...new Uint8Array(bytes)].map((byte) => byte.toString(16).padStart(2, "0")).join("");
}

async function sha256Hex(text) {
  return hex(await crypto.subtle.digest("SHA-256", encoder.encode(text)));
}

let hmacKey = null; // [key text, CryptoKey]: imported once per key

async function hmacHex(key, message) {
  if (hmacKey === null || hmacKey[0] !== key) {
    const imported = await crypto.subtle.importKey("raw", encoder.encode(key), { name: "HMAC", hash: "SHA-256" }, false, [
      "sign",
    ]);
    hmacKey = [key, imported];
  }
  return hex(await crypto.subtle.sign("HMAC", hmacKey[1], encoder.encode(message)));
}

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** zlib.crc32 of `text`'s UTF-8 bytes: the engine's split bucket (admission.py:split_variant). */
export function crc32(text) {
  let crc = 0xffffffff;
  for (const byte of encoder.encode(text)) crc = CRC_TABLE[(crc ^ byte) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}
