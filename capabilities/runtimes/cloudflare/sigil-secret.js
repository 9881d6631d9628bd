// Sigil's secret, compared in constant time: imported by Sigil's Workers on Cloudflare (the
// pool's guard, the platform's dispatch Worker), uploaded beside them as sigil-secret.js.

export function sameSecret(given, expected) {
  const encoder = new TextEncoder();
  const a = encoder.encode(given || "");
  const b = encoder.encode(expected || "");
  // timingSafeEqual needs equal lengths; comparing b with itself keeps the time constant.
  return a.byteLength === b.byteLength && b.byteLength > 0
    ? crypto.subtle.timingSafeEqual(a, b)
    : (crypto.subtle.timingSafeEqual(b, b), false);
}
