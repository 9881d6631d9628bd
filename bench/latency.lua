-- wrk script for the latency runs: times every call itself and prints exact percentiles as
-- one JSON line for bench/invoke.py (the same fields as throughput.lua).
--
-- wrk's own histogram is corrected for coordinated omission: it adds synthetic samples for
-- the calls a stalled connection did not send, so over one connection a single 30 ms stall
-- (another process holding the CPU) turns into some 150 slow samples, and its p99 measures
-- how busy the machine was rather than how long calls took.

local ffi = require("ffi")
ffi.cdef([[
  typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
  int clock_gettime(int clock_id, bench_timespec *tp);
]])
local CLOCK_MONOTONIC = 1
local clock = ffi.new("bench_timespec")

local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, clock)
  return tonumber(clock.tv_sec) * 1e6 + tonumber(clock.tv_nsec) / 1e3
end

local threads = {}
local prepared, started

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  prepared = wrk.format()
  samples = {} -- global, so that done() can read it with thread:get()
end

function request()
  started = now_us()
  return prepared
end

function response(status, headers, body)
  samples[#samples + 1] = now_us() - started
end

local function percentile(sorted, p)
  return sorted[math.max(1, math.ceil(p / 100 * #sorted))]
end

function done(summary, latency, requests)
  local all = {}
  for _, thread in ipairs(threads) do
    for _, sample in ipairs(thread:get("samples")) do
      all[#all + 1] = sample
    end
  end
  table.sort(all)
  local total = 0
  for _, sample in ipairs(all) do
    total = total + sample
  end
  local errors = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d,'
      .. '"socket_errors":%d,"bad_status":%d}\n',
    summary.requests, summary.duration, percentile(all, 50), percentile(all, 99), total / #all, all[#all],
    errors.connect + errors.read + errors.write + errors.timeout, errors.status
  ))
end
