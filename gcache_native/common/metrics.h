// Process-wide counters and latency histograms, written by the store and the
// data server with relaxed atomics, read by STATS and the admin endpoint.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gcache {

constexpr int kHistogramBuckets = 32;  // bucket i: [2^i, 2^(i+1)) microseconds

struct Histogram {
  std::atomic<uint64_t> buckets[kHistogramBuckets] = {};
  std::atomic<uint64_t> sum_us{0};  // Prometheus `_sum`: rate(sum) / rate(count) is the mean
  void record_us(uint64_t us) {
    sum_us.fetch_add(us, std::memory_order_relaxed);
    int b = 0;
    while (us > 1 && b < kHistogramBuckets - 1) {
      us >>= 1;
      ++b;
    }
    buckets[b].fetch_add(1, std::memory_order_relaxed);
  }
};

// X-macro: one line per counter, so names stay in sync everywhere.
#define GCACHE_COUNTERS(X)       \
  X(hits_memory)                 \
  X(hits_disk)                   \
  X(misses)                      \
  X(puts_stored)                 \
  X(puts_exists)                 \
  X(puts_no_space)               \
  X(puts_too_large)              \
  X(removes)                     \
  X(bytes_in)                    \
  X(bytes_out)                   \
  X(evictions_memory)            \
  X(demotions_to_disk)           \
  X(evictions_disk)              \
  X(promotions_to_memory)        \
  X(lease_skips)                 \
  X(checksum_failures)           \
  X(checksum_failures_put)       \
  X(checksum_failures_read)      \
  X(disk_errors)                 \
  X(torn_records_skipped)        \
  X(segments_reclaimed)          \
  X(disk_copy_forwards)          \
  X(disk_copies_dropped)         \
  X(errors_bad_frame)            \
  X(errors_unknown_opcode)       \
  X(errors_limit_exceeded)       \
  X(errors_bad_version)          \
  X(errors_busy)                 \
  X(errors_internal)             \
  X(errors_timeout)              \
  X(connections_accepted)        \
  X(requests)                    \
  X(requests_stale_epoch)        \
  X(auth_successes)              \
  X(auth_failures)               \
  X(errors_unauthenticated)      \
  X(errors_forbidden)            \
  X(connections_refused_address) \
  X(connections_refused_tenant)  \
  X(connections_closed_for_room) \
  X(preauth_dropped)             \
  X(idle_closes)                 \
  X(puts_reserve_refused)        \
  X(meta_budget_refused)         \
  X(index_evictions)             \
  X(shm_attaches)                \
  X(shm_lease_expiries)          \
  X(shm_reservation_expiries)

#define GCACHE_HISTOGRAMS(X) \
  X(put_batch)               \
  X(get_batch)               \
  X(exists_batch)            \
  X(remove_batch)            \
  X(ping)                    \
  X(stats)                   \
  X(lookup)                  \
  X(reserve)                 \
  X(commit)

struct Metrics {
#define GCACHE_DECLARE_COUNTER(name) std::atomic<uint64_t> name{0};
  GCACHE_COUNTERS(GCACHE_DECLARE_COUNTER)
#undef GCACHE_DECLARE_COUNTER
#define GCACHE_DECLARE_HIST(name) Histogram latency_##name;
  GCACHE_HISTOGRAMS(GCACHE_DECLARE_HIST)
#undef GCACHE_DECLARE_HIST
  std::atomic<int64_t> connections_open{0};

  std::vector<std::pair<std::string, uint64_t>> counters() const {
    std::vector<std::pair<std::string, uint64_t>> out;
#define GCACHE_READ_COUNTER(name) out.emplace_back(#name, name.load(std::memory_order_relaxed));
    GCACHE_COUNTERS(GCACHE_READ_COUNTER)
#undef GCACHE_READ_COUNTER
    return out;
  }

  std::vector<std::pair<std::string, std::vector<uint64_t>>> histograms() const {
    std::vector<std::pair<std::string, std::vector<uint64_t>>> out;
#define GCACHE_READ_HIST(name)                                                                                    \
  {                                                                                                               \
    std::vector<uint64_t> v(kHistogramBuckets);                                                                   \
    for (int i = 0; i < kHistogramBuckets; ++i) v[i] = latency_##name.buckets[i].load(std::memory_order_relaxed); \
    out.emplace_back(#name, std::move(v));                                                                        \
  }
    GCACHE_HISTOGRAMS(GCACHE_READ_HIST)
#undef GCACHE_READ_HIST
    return out;
  }

  // Sum of every recorded latency per histogram, in microseconds.
  std::vector<std::pair<std::string, uint64_t>> histogram_sums_us() const {
    std::vector<std::pair<std::string, uint64_t>> out;
#define GCACHE_READ_HIST_SUM(name) out.emplace_back(#name, latency_##name.sum_us.load(std::memory_order_relaxed));
    GCACHE_HISTOGRAMS(GCACHE_READ_HIST_SUM)
#undef GCACHE_READ_HIST_SUM
    return out;
  }
};

}  // namespace gcache
