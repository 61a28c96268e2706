// shm_read_scatter: leased values copied from a mapped arena straight into their final
// places (the runs of an engine's KV blocks), with no staging copy between. Each value's
// checksum is computed over the arena's bytes BEFORE any of its runs is copied: a value that
// does not match is reported and none of its bytes reach its runs. Under the LOOKUP's lease
// the arena bytes do not change, so the bytes copied are the bytes hashed; the hash pass
// leaves the value in cache for the copy (one pass over memory for a value up to the L2's
// size). The caller (the client's LookupOp) re-checks the lease's deadline after the call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/checksum.h"

namespace py = pybind11;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
constexpr size_t kHashChunkBytes = 64 << 10;

const uint64_t* data_of(const U64Array& a, size_t n, const char* what) {
  if (a.ndim() != 1 || size_t(a.size()) != n)
    throw py::value_error(std::string("shm_read_scatter: ") + what + " has the wrong length");
  return a.data();
}

py::list read_scatter(py::buffer arena_buf, const std::vector<uint64_t>& offsets, const std::vector<int64_t>& lens,
                      const std::vector<uint64_t>& sums, const std::vector<uint8_t>& kinds, const U64Array& run_first,
                      const U64Array& run_dst, const U64Array& run_at, const U64Array& run_len, bool verify) {
  const size_t n = lens.size();
  if (offsets.size() != n || sums.size() != n)
    throw py::value_error("offsets, lens and sums must have one entry per key");
  if (!kinds.empty() && kinds.size() != n) throw py::value_error("kinds must be empty or have one entry per key");
  const uint64_t* first = data_of(run_first, n + 1, "run_first");
  const size_t runs = size_t(first[n]);
  const uint64_t* dst = data_of(run_dst, runs, "run_dst");
  const uint64_t* at = data_of(run_at, runs, "run_at");
  const uint64_t* len = data_of(run_len, runs, "run_len");
  py::buffer_info info = arena_buf.request(true);
  const uint8_t* base = static_cast<const uint8_t*>(info.ptr);
  const uint64_t size = uint64_t(info.size) * uint64_t(info.itemsize);
  std::vector<gcache::ChecksumKind> kind(n, gcache::ChecksumKind::Xxh64);  // none named: all xxh64
  for (size_t i = 0; i < n; ++i) {
    if (first[i] > first[i + 1]) throw py::value_error("shm_read_scatter: run_first must not decrease");
    if (!kinds.empty()) {
      if (!gcache::checksum_kind_valid(kinds[i])) throw py::value_error("unknown checksum kind in \"cks\"");
      kind[i] = gcache::ChecksumKind(kinds[i]);
    }
    if (lens[i] < 0) continue;
    for (uint64_t r = first[i]; r < first[i + 1]; ++r) {  // every run inside its value, none null
      if (at[r] > uint64_t(lens[i]) || len[r] > uint64_t(lens[i]) - at[r])
        throw py::value_error("shm_read_scatter: a run lies outside its value");
      if (len[r] != 0 && dst[r] == 0) throw py::value_error("shm_read_scatter: a null destination");
    }
  }
  std::vector<uint8_t> bad(n, 0);
  PyThreadState* saved = PyEval_SaveThread();  // never throws below: copies and hashes only
  for (size_t i = 0; i < n; ++i) {
    if (lens[i] < 0) continue;
    const uint64_t length = uint64_t(lens[i]);
    if (offsets[i] > size || length > size - offsets[i]) {  // outside the mapping: a wrong answer
      bad[i] = 1;
      continue;
    }
    const uint8_t* src = base + offsets[i];
    if (verify) {
      gcache::ChecksumStream h(kind[i]);
      for (uint64_t c = 0; c < length; c += kHashChunkBytes)
        h.update(src + c, size_t(std::min<uint64_t>(kHashChunkBytes, length - c)));
      if (h.digest() != sums[i]) {
        bad[i] = 1;
        continue;
      }
    }
    for (uint64_t r = first[i]; r < first[i + 1]; ++r)
      if (len[r] != 0) std::memcpy(reinterpret_cast<void*>(dst[r]), src + at[r], size_t(len[r]));
  }
  PyEval_RestoreThread(saved);
  py::list out;
  for (size_t i = 0; i < n; ++i)
    if (bad[i]) out.append(i);
  return out;
}

}  // namespace

void bind_shm_scatter(py::module_& m) {
  m.def("shm_read_scatter", &read_scatter, py::arg("arena"), py::arg("offsets"), py::arg("lens"), py::arg("sums"),
        py::arg("kinds"), py::arg("run_first"), py::arg("run_dst"), py::arg("run_at"), py::arg("run_len"),
        py::arg("verify"),
        "Copies each found value (lens[i] >= 0) of a mapped arena into its runs: run r of value i "
        "(run_first[i] <= r < run_first[i+1]) takes run_len[r] bytes at run_at[r] of the value to "
        "address run_dst[r]. With verify, a value whose checksum (kinds[i]: 0 xxh64, 1 XXH3; empty: all "
        "xxh64) differs from sums[i] copies nothing. Returns the indices that failed their checksum or "
        "lie outside the arena. The GIL is released; the caller vouches for the destinations.");
}
