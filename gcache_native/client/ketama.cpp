// Ketama placement of many keys at once, for the cluster client.
//
// A key's point is the first 4 bytes of md5(key) read little-endian, exactly
// uhashring's KetamaRing.hashi(key, 0) for an ASCII key; its owner is the ring
// point just above it. hashlib costs a Python object per key and
// numpy.searchsorted is slow on unsorted needles, so both run here over a
// whole batch with the GIL released. MD5 (RFC 1321) is written out: only its
// first digest word is needed.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

inline uint32_t rotl(uint32_t x, int c) { return (x << c) | (x >> (32 - c)); }

inline uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// One MD5 step: a = b + rotl(a + f(b, c, d) + m + t, s), rounds fully unrolled
// (a loop with per-step table lookups runs about twice as slow).
#define GC_MD5_F(x, y, z) ((z) ^ ((x) & ((y) ^ (z))))
#define GC_MD5_G(x, y, z) ((y) ^ ((z) & ((x) ^ (y))))
#define GC_MD5_H(x, y, z) ((x) ^ (y) ^ (z))
#define GC_MD5_I(x, y, z) ((y) ^ ((x) | ~(z)))
#define GC_MD5_STEP(f, a, b, c, d, m, t, s)    \
  (a) += f((b), (c), (d)) + (m) + uint32_t(t); \
  (a) = rotl((a), (s)) + (b)

void md5_block(uint32_t state[4], const uint8_t* block) {
  uint32_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load_le32(block + 4 * i);
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  // Constants: floor(abs(sin(i + 1)) * 2^32), RFC 1321 section 3.4.
  GC_MD5_STEP(GC_MD5_F, a, b, c, d, m[0], 0xd76aa478, 7);
  GC_MD5_STEP(GC_MD5_F, d, a, b, c, m[1], 0xe8c7b756, 12);
  GC_MD5_STEP(GC_MD5_F, c, d, a, b, m[2], 0x242070db, 17);
  GC_MD5_STEP(GC_MD5_F, b, c, d, a, m[3], 0xc1bdceee, 22);
  GC_MD5_STEP(GC_MD5_F, a, b, c, d, m[4], 0xf57c0faf, 7);
  GC_MD5_STEP(GC_MD5_F, d, a, b, c, m[5], 0x4787c62a, 12);
  GC_MD5_STEP(GC_MD5_F, c, d, a, b, m[6], 0xa8304613, 17);
  GC_MD5_STEP(GC_MD5_F, b, c, d, a, m[7], 0xfd469501, 22);
  GC_MD5_STEP(GC_MD5_F, a, b, c, d, m[8], 0x698098d8, 7);
  GC_MD5_STEP(GC_MD5_F, d, a, b, c, m[9], 0x8b44f7af, 12);
  GC_MD5_STEP(GC_MD5_F, c, d, a, b, m[10], 0xffff5bb1, 17);
  GC_MD5_STEP(GC_MD5_F, b, c, d, a, m[11], 0x895cd7be, 22);
  GC_MD5_STEP(GC_MD5_F, a, b, c, d, m[12], 0x6b901122, 7);
  GC_MD5_STEP(GC_MD5_F, d, a, b, c, m[13], 0xfd987193, 12);
  GC_MD5_STEP(GC_MD5_F, c, d, a, b, m[14], 0xa679438e, 17);
  GC_MD5_STEP(GC_MD5_F, b, c, d, a, m[15], 0x49b40821, 22);

  GC_MD5_STEP(GC_MD5_G, a, b, c, d, m[1], 0xf61e2562, 5);
  GC_MD5_STEP(GC_MD5_G, d, a, b, c, m[6], 0xc040b340, 9);
  GC_MD5_STEP(GC_MD5_G, c, d, a, b, m[11], 0x265e5a51, 14);
  GC_MD5_STEP(GC_MD5_G, b, c, d, a, m[0], 0xe9b6c7aa, 20);
  GC_MD5_STEP(GC_MD5_G, a, b, c, d, m[5], 0xd62f105d, 5);
  GC_MD5_STEP(GC_MD5_G, d, a, b, c, m[10], 0x02441453, 9);
  GC_MD5_STEP(GC_MD5_G, c, d, a, b, m[15], 0xd8a1e681, 14);
  GC_MD5_STEP(GC_MD5_G, b, c, d, a, m[4], 0xe7d3fbc8, 20);
  GC_MD5_STEP(GC_MD5_G, a, b, c, d, m[9], 0x21e1cde6, 5);
  GC_MD5_STEP(GC_MD5_G, d, a, b, c, m[14], 0xc33707d6, 9);
  GC_MD5_STEP(GC_MD5_G, c, d, a, b, m[3], 0xf4d50d87, 14);
  GC_MD5_STEP(GC_MD5_G, b, c, d, a, m[8], 0x455a14ed, 20);
  GC_MD5_STEP(GC_MD5_G, a, b, c, d, m[13], 0xa9e3e905, 5);
  GC_MD5_STEP(GC_MD5_G, d, a, b, c, m[2], 0xfcefa3f8, 9);
  GC_MD5_STEP(GC_MD5_G, c, d, a, b, m[7], 0x676f02d9, 14);
  GC_MD5_STEP(GC_MD5_G, b, c, d, a, m[12], 0x8d2a4c8a, 20);

  GC_MD5_STEP(GC_MD5_H, a, b, c, d, m[5], 0xfffa3942, 4);
  GC_MD5_STEP(GC_MD5_H, d, a, b, c, m[8], 0x8771f681, 11);
  GC_MD5_STEP(GC_MD5_H, c, d, a, b, m[11], 0x6d9d6122, 16);
  GC_MD5_STEP(GC_MD5_H, b, c, d, a, m[14], 0xfde5380c, 23);
  GC_MD5_STEP(GC_MD5_H, a, b, c, d, m[1], 0xa4beea44, 4);
  GC_MD5_STEP(GC_MD5_H, d, a, b, c, m[4], 0x4bdecfa9, 11);
  GC_MD5_STEP(GC_MD5_H, c, d, a, b, m[7], 0xf6bb4b60, 16);
  GC_MD5_STEP(GC_MD5_H, b, c, d, a, m[10], 0xbebfbc70, 23);
  GC_MD5_STEP(GC_MD5_H, a, b, c, d, m[13], 0x289b7ec6, 4);
  GC_MD5_STEP(GC_MD5_H, d, a, b, c, m[0], 0xeaa127fa, 11);
  GC_MD5_STEP(GC_MD5_H, c, d, a, b, m[3], 0xd4ef3085, 16);
  GC_MD5_STEP(GC_MD5_H, b, c, d, a, m[6], 0x04881d05, 23);
  GC_MD5_STEP(GC_MD5_H, a, b, c, d, m[9], 0xd9d4d039, 4);
  GC_MD5_STEP(GC_MD5_H, d, a, b, c, m[12], 0xe6db99e5, 11);
  GC_MD5_STEP(GC_MD5_H, c, d, a, b, m[15], 0x1fa27cf8, 16);
  GC_MD5_STEP(GC_MD5_H, b, c, d, a, m[2], 0xc4ac5665, 23);

  GC_MD5_STEP(GC_MD5_I, a, b, c, d, m[0], 0xf4292244, 6);
  GC_MD5_STEP(GC_MD5_I, d, a, b, c, m[7], 0x432aff97, 10);
  GC_MD5_STEP(GC_MD5_I, c, d, a, b, m[14], 0xab9423a7, 15);
  GC_MD5_STEP(GC_MD5_I, b, c, d, a, m[5], 0xfc93a039, 21);
  GC_MD5_STEP(GC_MD5_I, a, b, c, d, m[12], 0x655b59c3, 6);
  GC_MD5_STEP(GC_MD5_I, d, a, b, c, m[3], 0x8f0ccc92, 10);
  GC_MD5_STEP(GC_MD5_I, c, d, a, b, m[10], 0xffeff47d, 15);
  GC_MD5_STEP(GC_MD5_I, b, c, d, a, m[1], 0x85845dd1, 21);
  GC_MD5_STEP(GC_MD5_I, a, b, c, d, m[8], 0x6fa87e4f, 6);
  GC_MD5_STEP(GC_MD5_I, d, a, b, c, m[15], 0xfe2ce6e0, 10);
  GC_MD5_STEP(GC_MD5_I, c, d, a, b, m[6], 0xa3014314, 15);
  GC_MD5_STEP(GC_MD5_I, b, c, d, a, m[13], 0x4e0811a1, 21);
  GC_MD5_STEP(GC_MD5_I, a, b, c, d, m[4], 0xf7537e82, 6);
  GC_MD5_STEP(GC_MD5_I, d, a, b, c, m[11], 0xbd3af235, 10);
  GC_MD5_STEP(GC_MD5_I, c, d, a, b, m[2], 0x2ad7d2bb, 15);
  GC_MD5_STEP(GC_MD5_I, b, c, d, a, m[9], 0xeb86d391, 21);
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
}

#undef GC_MD5_STEP
#undef GC_MD5_F
#undef GC_MD5_G
#undef GC_MD5_H
#undef GC_MD5_I

// The first digest word of md5(data): digest bytes 0..3 read little-endian.
uint32_t md5_first_word(const uint8_t* data, size_t length) {
  uint32_t state[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
  size_t whole = length & ~size_t(63);
  for (size_t off = 0; off < whole; off += 64) md5_block(state, data + off);
  // Padding: 0x80, zeros, then the bit length (little-endian) in the last 8 bytes.
  uint8_t tail[128] = {};
  const size_t rest = length - whole;
  std::memcpy(tail, data + whole, rest);
  tail[rest] = 0x80;
  const size_t tail_bytes = rest < 56 ? 64 : 128;
  const uint64_t bits = uint64_t(length) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_bytes - 8 + i] = uint8_t(bits >> (8 * i));
  md5_block(state, tail);
  if (tail_bytes == 128) md5_block(state, tail + 64);
  return state[0];
}

// Below this many keys, releasing and retaking the GIL costs more than it frees.
constexpr size_t kReleaseGilKeysMin = 64;

py::bytes ketama_hashes(py::handle keys) {
  // A tuple copy holds a reference to every key, so no other thread can free
  // one (by changing the caller's list) while the GIL is released.
  py::tuple held = py::reinterpret_steal<py::tuple>(PySequence_Tuple(keys.ptr()));
  if (!held) throw py::error_already_set();
  const size_t n = size_t(PyTuple_GET_SIZE(held.ptr()));
  std::vector<const uint8_t*> data(n);
  std::vector<size_t> lengths(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* key = PyTuple_GET_ITEM(held.ptr(), Py_ssize_t(i));
    if (!PyBytes_Check(key))
      throw py::type_error(std::string("ketama_hashes: every key must be bytes, got ") + Py_TYPE(key)->tp_name +
                           " at index " + std::to_string(i) + " (gcache.protocol.normalize_keys makes bytes)");
    data[i] = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(key));
    lengths[i] = size_t(PyBytes_GET_SIZE(key));
  }
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n * 4));
  if (out == nullptr) throw py::error_already_set();
  py::bytes result = py::reinterpret_steal<py::bytes>(out);
  uint8_t* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
  auto hash_all = [&] {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t h = md5_first_word(data[i], lengths[i]);
      dst[4 * i] = uint8_t(h);
      dst[4 * i + 1] = uint8_t(h >> 8);
      dst[4 * i + 2] = uint8_t(h >> 16);
      dst[4 * i + 3] = uint8_t(h >> 24);
    }
  };
  if (n < kReleaseGilKeysMin) {
    hash_all();
  } else {
    // Not gil_scoped_release: see client/io_bindings.cpp (daemon threads at exit).
    PyThreadState* saved = PyEval_SaveThread();
    hash_all();  // never throws
    PyEval_RestoreThread(saved);
  }
  return result;
}

uint32_t ketama_hash(py::handle key) {
  if (!PyBytes_Check(key.ptr()))
    throw py::type_error(std::string("ketama_hash: the key must be bytes, got ") + Py_TYPE(key.ptr())->tp_name);
  return md5_first_word(reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(key.ptr())),
                        size_t(PyBytes_GET_SIZE(key.ptr())));
}

// A contiguous buffer of uint32 (numpy uint32, or bytes from ketama_hashes).
struct U32View {
  py::buffer_info info;
  const uint32_t* data;
  size_t count;
};

U32View u32_view(py::handle obj, const char* what) {
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
  size_t count;
  if (PyBytes_Check(obj.ptr())) {
    if (info.size % 4 != 0) throw py::value_error(std::string(what) + ": bytes length must be a multiple of 4");
    count = size_t(info.size) / 4;
  } else {
    const std::string& f = info.format;
    if (info.itemsize != 4 || f.empty() || f.back() != 'I' || info.ndim != 1 ||
        !PyBuffer_IsContiguous(info.view(), 'C'))
      throw py::type_error(std::string(what) + ": pass a 1-d contiguous uint32 array (numpy dtype uint32) or bytes");
    count = size_t(info.size);
  }
  if (reinterpret_cast<uintptr_t>(info.ptr) % alignof(uint32_t) != 0)
    throw py::value_error(std::string(what) +
                          ": the buffer is not 4-byte aligned; pass a copy "
                          "(numpy.ascontiguousarray or bytes(...))");
  const auto* data = static_cast<const uint32_t*>(info.ptr);
  return U32View{std::move(info), data, count};
}

// Below this many needles a bucket table costs more than it saves.
constexpr size_t kBucketSearchKeysMin = 256;
constexpr int kBucketBitsMax = 20;  // 4 MiB of table at most, for rings of > 500k points

size_t upper_bound_index(const uint32_t* points, size_t count, uint32_t x) {
  return size_t(std::upper_bound(points, points + count, x) - points);  // bisect_right
}

py::bytes ketama_search(py::handle points_obj, py::handle needles_obj) {
  const U32View points = u32_view(points_obj, "ketama_search points");
  const U32View needles = u32_view(needles_obj, "ketama_search needles");
  if (points.count == 0) throw py::value_error("ketama_search: the ring has no points (an empty ring owns nothing)");
  const size_t n = needles.count;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n * 4));
  if (out == nullptr) throw py::error_already_set();
  py::bytes result = py::reinterpret_steal<py::bytes>(out);
  auto* dst = reinterpret_cast<uint32_t*>(PyBytes_AS_STRING(out));  // CPython aligns bytes data
  const uint32_t* first = points.data;
  const size_t count = points.count;
  auto wrap = [count](size_t at) { return at == count ? 0u : uint32_t(at); };  // past the last: the first
  // A binary search over a few thousand points waits on ~12 dependent loads
  // per key. For a big batch instead: a table, per bucket of the top `bits`
  // bits of a point, of the first point in that bucket or above; a key then
  // searches only its bucket's points (fewer than 2 on average: there are at
  // least 2x more buckets than points). Building it costs about as much as
  // 1,000 binary searches. Allocated here, before the GIL is released.
  const bool use_buckets = n >= kBucketSearchKeysMin;
  int bits = 1;
  while (use_buckets && (size_t(1) << bits) < 2 * count && bits < kBucketBitsMax) ++bits;
  const int shift = 32 - bits;
  std::vector<uint32_t> bucket_first(use_buckets ? (size_t(1) << bits) + 1 : 0);
  auto search_all = [&] {
    if (!use_buckets) {
      for (size_t i = 0; i < n; ++i) dst[i] = wrap(upper_bound_index(first, count, needles.data[i]));
      return;
    }
    size_t at = 0;
    for (size_t b = 0; b + 1 < bucket_first.size(); ++b) {
      const uint64_t bucket_low = uint64_t(b) << shift;
      while (at < count && first[at] < bucket_low) ++at;
      bucket_first[b] = uint32_t(at);
    }
    bucket_first.back() = uint32_t(count);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t x = needles.data[i];
      const size_t lo = bucket_first[x >> shift];
      const size_t hi = bucket_first[(x >> shift) + 1];  // the answer lies in [lo, hi]
      size_t j = lo;
      if (hi - lo <= 8) {
        while (j < hi && first[j] <= x) ++j;
      } else {
        j = lo + upper_bound_index(first + lo, hi - lo, x);
      }
      dst[i] = wrap(j);
    }
  };
  // The caller's buffers stay exported (info), so they cannot be resized meanwhile.
  if (n < kReleaseGilKeysMin) {
    search_all();
  } else {
    PyThreadState* saved = PyEval_SaveThread();
    search_all();  // never throws
    PyEval_RestoreThread(saved);
  }
  return result;
}

// Weighted rendezvous (highest random weight) placement: a key belongs to the
// node with the smallest -ln(u(key, node)) / weight, u uniform in (0, 1] from
// a hash of the key's ketama point and the node's seed. A node's share is its
// weight over the total, and a change of one node (join, leave, weight) moves
// only keys to or from that node. Every client, node and master must pick the
// same owner, so the score is computed with IEEE +, -, *, / only (correctly
// rounded everywhere, and no fused multiply-add: GC_NO_FMA), the same steps as
// gcache.cluster.rendezvous.score in Python.
#if defined(__clang__)
#define GC_NO_FMA_BEGIN _Pragma("clang fp contract(off)")
#define GC_NO_FMA_ATTR
#elif defined(__GNUC__)
#define GC_NO_FMA_BEGIN
#define GC_NO_FMA_ATTR __attribute__((optimize("fp-contract=off")))
#else
#define GC_NO_FMA_BEGIN
#define GC_NO_FMA_ATTR
#endif

inline uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

constexpr double kLn2 = 0.6931471805599453;
constexpr double kSqrt2 = 1.4142135623730951;
constexpr int kSeriesTerms = 12;  // |s| <= 0.172: the 12th term is below 1e-18

// -ln(m / 2^53) for an integer m in [1, 2^53]: m = f * 2^e exactly, f in
// [sqrt(1/2), sqrt(2)), ln f = 2 atanh(s) with s = (f - 1) / (f + 1).
GC_NO_FMA_ATTR double neg_ln_unit(uint64_t m) {
  GC_NO_FMA_BEGIN
  int e = 63 - __builtin_clzll(m);
  double f = double(m) / double(uint64_t(1) << e);  // exact: m < 2^54, a power of two divides
  if (f > kSqrt2) {
    f = f / 2.0;
    e += 1;
  }
  const double s = (f - 1.0) / (f + 1.0);
  const double s2 = s * s;
  double p = 1.0 / double(2 * kSeriesTerms + 1);
  for (int k = kSeriesTerms - 1; k >= 0; --k) p = p * s2 + 1.0 / double(2 * k + 1);
  const double ln_m = double(e) * kLn2 + 2.0 * s * p;
  return 53.0 * kLn2 - ln_m;
}

GC_NO_FMA_ATTR double rendezvous_score(uint32_t point, uint64_t seed, double weight) {
  GC_NO_FMA_BEGIN
  const uint64_t x = fmix64(seed ^ fmix64(uint64_t(point)));
  return neg_ln_unit((x >> 11) + 1) / weight;
}

template <typename T>
std::vector<T> le_words(py::bytes b, const char* what) {
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &len) != 0) throw py::error_already_set();
  if (len % Py_ssize_t(sizeof(T)) != 0) throw py::value_error(std::string(what) + ": length is not whole words");
  std::vector<T> out(size_t(len) / sizeof(T));
  std::memcpy(out.data(), data, size_t(len));
  return out;
}

// Slot (index into seeds) of every point's owner; ties go to the lower slot.
py::bytes rendezvous_slots(py::handle points_obj, py::bytes seeds_b, py::bytes weights_b) {
  const U32View points = u32_view(points_obj, "rendezvous_slots points");
  const std::vector<uint64_t> seeds = le_words<uint64_t>(seeds_b, "rendezvous_slots seeds");
  const std::vector<uint32_t> weights_u = le_words<uint32_t>(weights_b, "rendezvous_slots weights");
  if (seeds.empty() || seeds.size() != weights_u.size())
    throw py::value_error("rendezvous_slots: one weight per seed, at least one node");
  std::vector<double> weights(weights_u.begin(), weights_u.end());
  for (double w : weights)
    if (w < 1) throw py::value_error("rendezvous_slots: every weight must be >= 1");
  const size_t n = points.count;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n * 4));
  if (out == nullptr) throw py::error_already_set();
  py::bytes result = py::reinterpret_steal<py::bytes>(out);
  auto* dst = reinterpret_cast<uint32_t*>(PyBytes_AS_STRING(out));
  const size_t nodes = seeds.size();
  auto place_all = [&] {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t point = points.data[i];
      size_t best = 0;
      double best_score = rendezvous_score(point, seeds[0], weights[0]);
      for (size_t j = 1; j < nodes; ++j) {
        const double score = rendezvous_score(point, seeds[j], weights[j]);
        if (score < best_score) {
          best_score = score;
          best = j;
        }
      }
      dst[i] = uint32_t(best);
    }
  };
  if (n * nodes < kReleaseGilKeysMin * 16) {
    place_all();
  } else {
    PyThreadState* saved = PyEval_SaveThread();
    place_all();  // never throws
    PyEval_RestoreThread(saved);
  }
  return result;
}

}  // namespace

void bind_ketama(py::module_& m) {
  m.def("ketama_hashes", &ketama_hashes, py::arg("keys"),
        R"doc(Ketama points of `keys` (a sequence of bytes): len(keys) little-endian uint32s.

Each is the first 4 bytes of md5(key) read little-endian, which is uhashring's
KetamaRing.hashi(key, 0) for an ASCII key. Hashes with the GIL released.
np.frombuffer(ketama_hashes(keys), dtype="<u4") gives them as an array.)doc");
  m.def("ketama_hash", &ketama_hash, py::arg("key"),
        "The ketama point of one key (bytes): ketama_hashes([key]) as an int, for single-key calls.");
  m.def("rendezvous_slots", &rendezvous_slots, py::arg("points"), py::arg("seeds"), py::arg("weights"),
        R"doc(Weighted rendezvous owner of each point (e.g. ketama_hashes(keys)): for each, the
index of the node with the smallest -ln(u) / weight, u from fmix64(seed ^ fmix64(point)).

seeds: bytes of native uint64 (one per node), weights: bytes of native uint32 (>= 1).
Returns native uint32s (np.frombuffer(..., dtype=np.uint32)). GIL released.
gcache.cluster.rendezvous documents the score step by step.)doc");
  m.def("ketama_search", &ketama_search, py::arg("points"), py::arg("needles"),
        R"doc(For each needle, the index of the first ring point above it (bisect_right),
or 0 when it is above the last point (the ring wraps), as native uint32s.

points: the ring's sorted points; needles: e.g. ketama_hashes(keys). Both are
1-d contiguous uint32 arrays or bytes of native uint32s. GIL released.
np.frombuffer(ketama_search(points, needles), dtype=np.uint32) gives an array.)doc");
}
