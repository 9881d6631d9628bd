-- wrk script for the throughput runs: print wrk's summary as one JSON line for
-- bench/invoke.py (the same fields as latency.lua). wrk keeps latencies in microseconds;
-- errors.status counts answers outside 2xx/3xx.

done = function(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d,'
      .. '"socket_errors":%d,"bad_status":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    latency.max, errors.connect + errors.read + errors.write + errors.timeout, errors.status
  ))
end
