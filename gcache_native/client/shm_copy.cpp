// Client side of the one-sided transports: copies between a mapped arena and
// the caller's buffers with the GIL released, each value's checksum (XXH3 for
// new values, xxh64 for old ones: ChecksumKind) computed in the same pass
// (common/xxh3_copy.h: fused into the copy, or chunk by chunk while in cache;
// each value whole on one thread), across the threads of
// one persistent, bounded copy pool for large batches. A value whose bytes do
// not match the checksum the server gave is reported, never returned as a hit.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/shm_copy.h"
#include "common/assert.h"
#include "common/checksum.h"
#include "common/xxh3_copy.h"

namespace py = pybind11;

namespace gcache::shm_copy {
namespace {

constexpr size_t kBytesPerThreadMin = 1 << 20;  // below it a thread costs more than it saves
constexpr int kThreadsMax = 8;

// Copies of at least this many bytes bypass the cache (streaming stores): glibc
// switches to them only for much larger copies, and a batch of 256 KiB values
// copied one by one then runs at half the memory bandwidth (bench/store/shm_kernels.py).
constexpr size_t kStreamingBytesMin = 128 << 10;
constexpr uint64_t kLastLevelCacheDefault = 8 << 20;  // where neither sysconf nor sysfs says

// The last-level cache's size: sysconf, else sysfs (VMs often leave sysconf at 0).
uint64_t last_level_cache_bytes() {
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return uint64_t(l3);
  std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  unsigned long kib = 0;
  char unit = 0;
  const bool read = f != nullptr && std::fscanf(f, "%lu%c", &kib, &unit) == 2 && unit == 'K';
  if (f != nullptr) std::fclose(f);
  return read && kib > 0 ? uint64_t(kib) << 10 : kLastLevelCacheDefault;
}

// Whether a call's copies bypass the cache. A write's destination is the arena, read
// later by another process if ever: streamed. A read's destination is the caller's
// buffer, which the caller reads next: a call whose bytes fit in 3/4 of the last-level
// cache (glibc's own rule for one large memcpy) keeps them there with plain stores;
// a larger one would only evict the rest, so it streams.
bool streams(Hash hash, uint64_t call_bytes) {
  static const uint64_t read_cached_max = last_level_cache_bytes() / 4 * 3;
  return hash == Hash::Source || call_bytes > read_cached_max;
}

// Copies n bytes with their checksum in one pass (common/xxh3_copy.h: XXH3 fused
// into the copy where the CPU has AVX2; elsewhere, and for xxh64, each chunk is
// hashed while in cache). A read hashes the bytes it delivers; a write the bytes
// it stores, so a source changed mid-copy makes the stored block differ from its
// sum, and every reader then refuses it.
uint64_t copy_and_hash(const uint8_t* src, uint8_t* dst, uint64_t n, Hash hash, gcache::ChecksumKind kind,
                       bool stream_call) {
  const bool stream = stream_call && n >= kStreamingBytesMin;
  if (hash == Hash::None) {
    gcache::copy_bytes(dst, src, n, stream);
    return 0;
  }
  const auto side = hash == Hash::Source ? gcache::HashSide::Source : gcache::HashSide::Destination;
  return gcache::copy_and_checksum(kind, side, dst, src, n, stream);
}

// The copy threads: started once (at most kThreadsMax - 1 helpers, the
// caller's thread is the last one), then reused by every large copy, instead
// of a thread started and joined per call. run() hands each helper one job
// and waits for them all; while one batch has the helpers, a batch from
// another Python thread is copied on its own thread (no waiting, no more
// threads than the pool's). A forked child starts a pool of
// its own (the parent's threads do not exist there).
class CopyPool {
 public:
  static CopyPool& get() {
    static const bool registered = [] {
      // The child leaks the parent's pool (its threads do not exist there) and makes its own.
      pthread_atfork(nullptr, nullptr, [] {
        instance_ = nullptr;
        create_mu_ = new std::mutex;
      });
      return true;
    }();
    (void)registered;
    std::lock_guard<std::mutex> lock(*create_mu_);
    if (instance_ == nullptr) instance_ = new CopyPool();  // never freed: helper threads outlive statics
    return *instance_;
  }

  // Runs jobs[0] on the calling thread and the others on helpers; returns once all are done.
  void run(std::vector<std::function<void()>>& jobs) {
    std::unique_lock<std::mutex> turn(turn_mu_, std::try_to_lock);
    if (!turn.owns_lock()) {  // another batch has the helpers: copy this one on the caller's thread
      for (std::function<void()>& job : jobs) job();
      return;
    }
    const size_t helpers_needed = jobs.size() - 1;
    GCACHE_ASSERT(helpers_needed <= size_t(kThreadsMax - 1));
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (threads_.size() < helpers_needed) threads_.emplace_back([this] { serve(); });
      for (size_t k = 1; k < jobs.size(); ++k) queue_.push_back(&jobs[k]);
      pending_ = helpers_needed;
    }
    work_cv_.notify_all();
    jobs[0]();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
  }

  size_t threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_.size();
  }

 private:
  CopyPool() = default;
  void serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return !queue_.empty(); });
      std::function<void()>* job = queue_.back();
      queue_.pop_back();
      lock.unlock();
      (*job)();  // never throws: copies and hashes only
      lock.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  static inline CopyPool* instance_ = nullptr;
  static inline std::mutex* create_mu_ = new std::mutex;
  std::mutex turn_mu_;  // one batch at a time
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::function<void()>*> queue_;
  size_t pending_ = 0;
  std::vector<std::thread> threads_;  // detached at exit with the process
};

}  // namespace

// Splits items into contiguous runs of about equal bytes, one per thread.
// With Hash::None, only copies (every sum stays 0).
void run_items(std::vector<CopyItem>& items, int threads, Hash hash) {
  uint64_t total = 0;
  for (const CopyItem& it : items) total += it.length;
  // hardware_concurrency() reads sysfs on every call (microseconds): once per process.
  static const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  int t = threads > 0 ? threads : std::min(kThreadsMax, cores);
  t = int(std::max<uint64_t>(1, std::min<uint64_t>(uint64_t(t), total / kBytesPerThreadMin)));
  t = std::min<int>(t, int(items.size()));
  const bool stream = streams(hash, total);
  auto work = [&items, hash, stream](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i)
      items[i].sum = copy_and_hash(items[i].src, items[i].dst, items[i].length, hash, items[i].kind, stream);
  };
  if (t <= 1) {
    work(0, items.size());
    return;
  }
  std::vector<size_t> bounds{0};
  const uint64_t share = total / uint64_t(t);
  uint64_t acc = 0;
  for (size_t i = 0; i < items.size() && bounds.size() < size_t(t); ++i) {
    acc += items[i].length;
    if (acc >= share * bounds.size()) bounds.push_back(i + 1);
  }
  if (bounds.back() != items.size()) bounds.push_back(items.size());
  std::vector<std::function<void()>> jobs;
  for (size_t k = 0; k + 1 < bounds.size(); ++k)
    jobs.emplace_back([&work, &bounds, k] { work(bounds[k], bounds[k + 1]); });
  if (jobs.size() == 1) {
    jobs[0]();
    return;
  }
  CopyPool::get().run(jobs);
}

size_t copy_pool_threads() { return CopyPool::get().threads(); }

}  // namespace gcache::shm_copy

namespace {
using gcache::shm_copy::CopyItem;
using gcache::shm_copy::Hash;
using gcache::shm_copy::run_items;

// The kind of each value's sum: "cks" of a LOOKUP answer, or empty (a node
// from before XXH3: every sum is xxh64).
gcache::ChecksumKind kind_at(const std::vector<uint8_t>& kinds, size_t i) {
  if (kinds.empty()) return gcache::ChecksumKind::Xxh64;
  if (!gcache::checksum_kind_valid(kinds[i])) throw py::value_error("unknown checksum kind in \"cks\"");
  return gcache::ChecksumKind(kinds[i]);
}

// Runs f without the GIL (not gil_scoped_release: see client/io_bindings.cpp).
template <class F>
void without_gil(F&& f) {
  PyThreadState* saved = PyEval_SaveThread();
  f();  // never throws
  PyEval_RestoreThread(saved);
}

struct Arena {
  py::buffer_info info;
  uint8_t* base;
  uint64_t size;
  explicit Arena(const py::buffer& b) : info(b.request(true)) {
    base = static_cast<uint8_t*>(info.ptr);
    size = uint64_t(info.size) * uint64_t(info.itemsize);
  }
  bool holds(uint64_t offset, uint64_t length) const { return offset <= size && length <= size - offset; }
};

void check_lengths(size_t n, const std::vector<uint64_t>& offsets, const std::vector<int64_t>& lens,
                   const std::vector<uint64_t>& sums) {
  if (offsets.size() != n || lens.size() != n || sums.size() != n)
    throw py::value_error("offsets, lens and sums must have one entry per key");
}

// Reads: found values (len >= 0) into targets; returns the indices whose bytes
// failed their checksum or lie outside the arena (not hits).
py::list read_into(py::buffer arena_buf, const std::vector<uint64_t>& offsets, const std::vector<int64_t>& lens,
                   const std::vector<uint64_t>& sums, py::list targets, int threads, bool verify,
                   const std::vector<uint8_t>& kinds) {
  const size_t n = targets.size();
  check_lengths(n, offsets, lens, sums);
  if (!kinds.empty() && kinds.size() != n) throw py::value_error("kinds must be empty or have one entry per key");
  Arena arena(arena_buf);
  std::vector<py::buffer_info> infos;  // keeps each target's export alive
  infos.reserve(n);
  std::vector<CopyItem> items;
  std::vector<size_t> index;
  py::list bad;
  for (size_t i = 0; i < n; ++i) {
    if (lens[i] < 0 || targets[i].is_none()) continue;
    infos.push_back(py::reinterpret_borrow<py::buffer>(targets[i]).request(true));
    const py::buffer_info& t = infos.back();
    const uint64_t len = uint64_t(lens[i]);
    if (uint64_t(t.size) * uint64_t(t.itemsize) < len) throw py::value_error("a target is smaller than its value");
    if (!arena.holds(offsets[i], len)) {
      bad.append(i);
      continue;
    }
    items.push_back(CopyItem{arena.base + offsets[i], static_cast<uint8_t*>(t.ptr), len, sums[i], kind_at(kinds, i)});
    index.push_back(i);
  }
  without_gil([&] { run_items(items, threads, verify ? Hash::Destination : Hash::None); });
  if (verify)
    for (size_t k = 0; k < items.size(); ++k)
      if (items[k].sum != items[k].expected) bad.append(index[k]);
  return bad;
}

// Reads into new bytes objects: a list with bytes per verified value, None
// for a miss or a value that failed its checksum (its index is in the second list).
py::tuple read_values(py::buffer arena_buf, const std::vector<uint64_t>& offsets, const std::vector<int64_t>& lens,
                      const std::vector<uint64_t>& sums, int threads, bool verify, const std::vector<uint8_t>& kinds) {
  const size_t n = lens.size();
  check_lengths(n, offsets, lens, sums);
  if (!kinds.empty() && kinds.size() != n) throw py::value_error("kinds must be empty or have one entry per key");
  Arena arena(arena_buf);
  py::list values(n), bad;
  std::vector<CopyItem> items;
  std::vector<size_t> index;
  for (size_t i = 0; i < n; ++i) {
    values[i] = py::none();
    if (lens[i] < 0) continue;
    const uint64_t len = uint64_t(lens[i]);
    if (!arena.holds(offsets[i], len)) {
      bad.append(i);
      continue;
    }
    // Filled below, before anyone else can see it (the C API allows this for a new object).
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(len));
    if (raw == nullptr) throw py::error_already_set();
    py::object value = py::reinterpret_steal<py::object>(raw);
    items.push_back(CopyItem{arena.base + offsets[i], reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw)), len, sums[i],
                             kind_at(kinds, i)});
    index.push_back(i);
    values[i] = value;
  }
  without_gil([&] { run_items(items, threads, verify ? Hash::Destination : Hash::None); });
  for (size_t k = 0; verify && k < items.size(); ++k) {
    if (items[k].sum != items[k].expected) {
      bad.append(index[k]);
      values[index[k]] = py::none();
    }
  }
  return py::make_tuple(values, bad);
}

// Writes: each source into the arena at its offset (offset < 0: skipped);
// returns the checksum of kind `kind` of the bytes written (0 for skipped ones), for COMMIT.
std::vector<uint64_t> write_from(py::buffer arena_buf, const std::vector<int64_t>& offsets, py::list sources,
                                 int threads, int kind) {
  const size_t n = sources.size();
  if (!gcache::checksum_kind_valid(uint64_t(kind))) throw py::value_error("unknown checksum kind");
  if (offsets.size() != n) throw py::value_error("offsets and sources must have one entry per value");
  Arena arena(arena_buf);
  std::vector<py::buffer_info> infos;
  infos.reserve(n);
  std::vector<CopyItem> items;
  std::vector<size_t> index;
  for (size_t i = 0; i < n; ++i) {
    if (offsets[i] < 0) continue;
    infos.push_back(py::reinterpret_borrow<py::buffer>(sources[i]).request(false));
    const py::buffer_info& s = infos.back();
    const uint64_t len = uint64_t(s.size) * uint64_t(s.itemsize);
    if (!arena.holds(uint64_t(offsets[i]), len)) throw py::value_error("a reserved block lies outside the arena");
    items.push_back(
        CopyItem{static_cast<const uint8_t*>(s.ptr), arena.base + offsets[i], len, 0, gcache::ChecksumKind(kind)});
    index.push_back(i);
  }
  without_gil([&] { run_items(items, threads, Hash::Source); });
  std::vector<uint64_t> out(n, 0);
  for (size_t k = 0; k < items.size(); ++k) out[index[k]] = items[k].sum;
  return out;
}

}  // namespace

// The indices of views whose bytes do not hash to their sum (None views skipped).
py::list verify_views(py::list views, const std::vector<uint64_t>& sums, const std::vector<uint8_t>& kinds) {
  if (sums.size() != views.size()) throw py::value_error("one sum per view");
  if (!kinds.empty() && kinds.size() != views.size()) throw py::value_error("kinds: empty or one per view");
  std::vector<gcache::ChecksumKind> kind;
  std::vector<py::buffer_info> infos;
  std::vector<std::pair<size_t, uint64_t>> got;
  infos.reserve(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].is_none()) continue;
    infos.push_back(py::reinterpret_borrow<py::buffer>(views[i]).request());
    got.emplace_back(i, 0);
    kind.push_back(kind_at(kinds, i));
  }
  without_gil([&] {
    for (size_t k = 0; k < got.size(); ++k)
      got[k].second = gcache::checksum_of(kind[k], infos[k].ptr, size_t(infos[k].size) * size_t(infos[k].itemsize));
  });
  py::list bad;
  for (const auto& [i, sum] : got)
    if (sum != sums[i]) bad.append(i);
  return bad;
}

void bind_shm_copy(py::module_& m) {
  const std::vector<uint8_t> none;
  m.def("verify_views", &verify_views, py::arg("views"), py::arg("sums"), py::arg("kinds") = none,
        "Indices of the views (None: skipped) whose checksum (kinds[i]; empty: all xxh64) differs from its "
        "sum (GIL released).");
  m.def("shm_read_into", &read_into, py::arg("arena"), py::arg("offsets"), py::arg("lens"), py::arg("sums"),
        py::arg("targets"), py::arg("threads") = 0, py::arg("verify") = true, py::arg("kinds") = none,
        "Copies each found value (len >= 0) from the mapped arena into its target, verifying its checksum "
        "(of kind kinds[i]: a LOOKUP's \"cks\"; empty: all xxh64) in the same pass unless verify is False "
        "(GIL released; threads 0 = automatic). Returns the indices that are not hits: bytes that failed the "
        "checksum, or a block outside the arena.");
  m.def("shm_read_values", &read_values, py::arg("arena"), py::arg("offsets"), py::arg("lens"), py::arg("sums"),
        py::arg("threads") = 0, py::arg("verify") = true, py::arg("kinds") = none,
        "As shm_read_into, into new bytes objects: returns (values, bad) with None for misses and bad values.");
  m.def("shm_write_from", &write_from, py::arg("arena"), py::arg("offsets"), py::arg("sources"), py::arg("threads") = 0,
        py::arg("kind") = int(gcache::kChecksumKindNew),
        "Copies each source into the mapped arena at its offset (offset < 0: skipped), hashing each source "
        "chunk just before it is copied; returns their checksums of `kind` (default XXH3; 0 for skipped).");
  m.def(
      "copy_pool_threads", [] { return gcache::shm_copy::copy_pool_threads(); },
      "Helper threads the persistent copy pool has started so far (at most 7).");
}
