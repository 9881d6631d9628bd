// A capability's secrets masked as `[secret NAME]` in what its console prints and in what the
// entry module Sigil uploads in front of it (the pool's guard, the platform's entry module)
// says of its failures, so that neither Cloudflare's logs of the script nor Sigil's answer,
// failure record or async result hold a value. Imported first by that entry module, so that it
// runs before any module of the capability's. The script knows which of its bindings are
// secrets by name only (SIGIL_SECRET_NAMES, a plain_text binding: a JSON list); their values
// are read from `env` at each call, as the capability reads them. The loader host masks
// alike in the module it loads before a capability (runtimes/host/host.js, consoleModule): a
// change to what is masked goes to both.

const NAMES_BINDING = "SIGIL_SECRET_NAMES";
let pairs = []; // [name, value], the longest value first; a value's JSON-escaped form too
let namesSeen = null;

/** The capability's `env` without Sigil's binding, the secrets it names noted for masking. */
export function useSecrets(env) {
  const { [NAMES_BINDING]: names, ...rest } = env;
  if (names !== namesSeen) {
    namesSeen = names;
    let listed = [];
    try {
      listed = JSON.parse(names || "[]");
    } catch {
      listed = [];
    }
    const found = [];
    for (const name of Array.isArray(listed) ? listed : []) {
      const value = rest[name];
      if (typeof value !== "string" || !value) continue;
      found.push([name, value]);
      const escaped = JSON.stringify(value).slice(1, -1); // as it appears inside an object's JSON
      if (escaped !== value) found.push([name, escaped]);
    }
    pairs = found.sort((a, b) => b[1].length - a[1].length);
  }
  return rest;
}

function holds(text) {
  return pairs.some(([, value]) => text.includes(value));
}

/** `text` with each secret's value replaced by `[secret NAME]`. */
export function masked(text) {
  let out = String(text ?? "");
  for (const [name, value] of pairs) out = out.split(value).join(`[secret ${name}]`);
  return out;
}

/** `error` as it may be told: itself when it names no secret, else an Error saying it masked. */
export function maskedError(error) {
  const stack = String((error && error.stack) || error);
  const message = String((error && error.message) || error);
  if (!pairs.length || !(holds(stack) || holds(message))) return error;
  const told = new Error(masked(message));
  told.name = String((error && error.name) || "Error");
  told.stack = masked(stack);
  return told;
}

function clean(arg) {
  if (typeof arg === "string") return holds(arg) ? masked(arg) : arg;
  let text;
  try {
    text = arg instanceof Error ? String(arg.stack || arg) : arg !== null && typeof arg === "object" ? JSON.stringify(arg) : undefined;
  } catch {
    return arg;
  }
  return typeof text === "string" && holds(text) ? masked(text) : arg;
}

// Every method (log, error, assert, count, group, timeLog, ...): each may print its arguments.
for (const method of Object.keys(console)) {
  const original = console[method];
  if (typeof original === "function") {
    console[method] = (...args) => original.apply(console, pairs.length ? args.map(clean) : args);
  }
}
