// Sigil's Tail Worker on Cloudflare: the worker-pool runtime uploads every capability script
// with it as its `tail_consumers`, and the platform runtime its dispatch Worker, whose Tail
// Worker receives the user Workers' events too (Workers for Platforms). It shapes each call's
// TraceItem into a call's record as the loader host's tail does (host.js, callRecord: lines
// and bytes bounded) and pushes the records to Sigil's origin in signed batches, spooling in
// its own Workers KV namespace (LOG_KV) what the origin does not take for now (host.js,
// flush). A TraceItem names its producer (`scriptName`), not the capability, and the Tail
// Worker holds no capability's secrets: the batches say so (`slots`), and Sigil names and
// masks the records as it takes them.

import { tailEvents } from "./host.js";

// The worker-pool guard (pool/guard.js) answers a capability's uncaught exception itself, and
// logs it under this mark: the call's record shows it as the exception it was.
const EXCEPTION_MARK = "[sigil:exception]";

function withGuarded(event) {
  const logs = event.logs || [];
  const marked = logs.find((entry) => Array.isArray(entry.message) && entry.message[0] === EXCEPTION_MARK);
  if (!marked) return event;
  const thrown = marked.message[1] || {};
  return {
    scriptName: event.scriptName,
    event: event.event,
    eventTimestamp: event.eventTimestamp,
    wallTime: event.wallTime,
    cpuTime: event.cpuTime,
    truncated: event.truncated,
    outcome: "exception",
    logs: logs.filter((entry) => entry !== marked),
    exceptions: [{ name: thrown.name, message: thrown.message, stack: thrown.stack, timestamp: marked.timestamp }],
  };
}

export default {
  fetch() {
    return new Response(null, { status: 404 });
  },
  async tail(events, env, ctx) {
    // The dispatch Worker's own event names no capability; SIGIL_TAIL_SKIP lists such Workers.
    const skip = new Set(JSON.parse(env.SIGIL_TAIL_SKIP || "[]"));
    const calls = events.filter((event) => event.scriptName && !skip.has(event.scriptName)).map(withGuarded);
    ctx.waitUntil(tailEvents(calls, env, (event) => ({ slot: event.scriptName, sha: "", secrets: {} })));
  },
};
