// Ketama point of many keys at once, for the cluster client's placement.
//
// A key's point is the first 4 bytes of md5(key) read little-endian, exactly
// uhashring's KetamaRing.hashi(key, 0) for an ASCII key. hashlib costs a
// Python object per key; this hashes a whole batch with the GIL released.
// MD5 (RFC 1321) is written out here: only its first digest word is needed.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
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
#define GC_MD5_STEP(f, a, b, c, d, m, t, s) \
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
      throw py::type_error(std::string("ketama_hashes: every key must be bytes, got ") +
                           Py_TYPE(key)->tp_name + " at index " + std::to_string(i) +
                           " (gcache.protocol.normalize_keys makes bytes)");
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
    // Not gil_scoped_release: see io_bindings.cpp (daemon threads at exit).
    PyThreadState* saved = PyEval_SaveThread();
    hash_all();  // never throws
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
}
