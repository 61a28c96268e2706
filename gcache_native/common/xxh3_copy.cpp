// The fused XXH3 copy kernel (common/xxh3_copy.h). It follows xxHash's long-input
// path (xxhash.h 0.8: XXH3_hashLong_64b_internal) stripe for stripe: 8 lanes of
// 64-bit accumulators; each 64-byte stripe n of a 1 KiB block adds the stripe
// (lanes swapped by pairs) and the 32x32-bit product of (stripe ^ secret[8n..])
// halves; after each full block the accumulators are scrambled with the
// secret's last 64 bytes; the last stripe is read at len - 64 (overlapping the
// previous ones) with the secret at 121; the 8 lanes then merge into one sum.
// Inputs of at most 240 bytes take XXH3's short paths: copied, then hashed.
// The SIMD functions carry their own target attribute, so the module still
// runs (at the portable level) on a CPU without AVX2.
#include "common/xxh3_copy.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define GCACHE_X86 1
#else
#define GCACHE_X86 0
#endif

namespace gcache {
namespace {

constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = 16;  // (secret size 192 - 64) / 8 secret bytes per stripe
constexpr size_t kShortMax = 240;        // XXH3_MIDSIZE_MAX: longer inputs take the stripe loop
constexpr size_t kScrambleAt = 192 - kStripe;
constexpr size_t kLastStripeAt = 192 - kStripe - 7;  // XXH_SECRET_LASTACC_START
constexpr size_t kMergeAt = 11;                      // XXH_SECRET_MERGEACCS_START
constexpr size_t kChunkBytes = 64 << 10;             // portable level: copied, then hashed while in L2

constexpr uint32_t kPrime32_1 = 0x9E3779B1U;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;

// clang-format off
// XXH3's default secret (XXH3_kSecret, from FARSH), and XXH3_INIT_ACC.
alignas(64) constexpr uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
alignas(64) constexpr uint64_t kInitAcc[8] = {
    0xC2B2AE3DULL,         0x9E3779B185EBCA87ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
    0x85EBCA77C2B2AE63ULL, 0x85EBCA77ULL,         0x27D4EB2F165667C5ULL, 0x9E3779B1ULL,
};
// clang-format on

uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian host (x86-64, aarch64): XXH_readLE64
}

uint64_t mul128_fold64(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return uint64_t(p) ^ uint64_t(p >> 64);
}

// XXH3_mergeAccs + XXH3_avalanche.
uint64_t merge_accs(const uint64_t acc[8], size_t n) {
  uint64_t h = uint64_t(n) * kPrime64_1;
  for (size_t i = 0; i < 4; ++i)
    h += mul128_fold64(acc[2 * i] ^ read64(kSecret + kMergeAt + 16 * i),
                       acc[2 * i + 1] ^ read64(kSecret + kMergeAt + 16 * i + 8));
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  h ^= h >> 32;
  return h;
}

// How the fused kernels store each stripe: plain stores, or non-temporal ones
// as wide as the destination's alignment allows.
enum class Store { Plain, Stream16, StreamWide };

#if GCACHE_X86

#define GCACHE_AVX2 __attribute__((target("avx2"), always_inline)) inline
#define GCACHE_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// ---- AVX2: the 8 lanes in two 32-byte registers ----

GCACHE_AVX2 __m256i acc_avx2(__m256i acc, __m256i data, const uint8_t* key) {
  const __m256i data_key = _mm256_xor_si256(data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i product = _mm256_mul_epu32(data_key, _mm256_shuffle_epi32(data_key, _MM_SHUFFLE(0, 3, 0, 1)));
  return _mm256_add_epi64(product, _mm256_add_epi64(acc, _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2))));
}

GCACHE_AVX2 __m256i scramble_avx2(__m256i acc, const uint8_t* key) {
  const __m256i prime = _mm256_set1_epi32(int(kPrime32_1));
  const __m256i mixed = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
  const __m256i data_key = _mm256_xor_si256(mixed, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i lo = _mm256_mul_epu32(data_key, prime);
  const __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(data_key, _MM_SHUFFLE(0, 3, 0, 1)), prime);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

template <Store kStore>
GCACHE_AVX2 void store_avx2(uint8_t* dst, __m256i v) {
  if constexpr (kStore == Store::StreamWide) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  } else if constexpr (kStore == Store::Stream16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(v));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), _mm256_extracti128_si256(v, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
}

// One stripe: loaded once, stored, accumulated from the same registers.
template <Store kStore>
GCACHE_AVX2 void stripe_avx2(__m256i& a0, __m256i& a1, uint8_t* dst, const uint8_t* src, const uint8_t* key) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  store_avx2<kStore>(dst, v0);
  store_avx2<kStore>(dst + 32, v1);
  a0 = acc_avx2(a0, v0, key);
  a1 = acc_avx2(a1, v1, key + 32);
}

template <Store kStore>
__attribute__((target("avx2"))) uint64_t fused_avx2(uint8_t* dst, const uint8_t* src, size_t n) {
  __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInitAcc));
  __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInitAcc + 4));
  const size_t stripes = (n - 1) / kStripe;  // before the last, overlapping one
  size_t at = 0;
  for (size_t b = 0; b < stripes / kStripesPerBlock; ++b) {
#pragma GCC unroll 16
    for (size_t s = 0; s < kStripesPerBlock; ++s, at += kStripe)
      stripe_avx2<kStore>(a0, a1, dst + at, src + at, kSecret + 8 * s);
    a0 = scramble_avx2(a0, kSecret + kScrambleAt);
    a1 = scramble_avx2(a1, kSecret + kScrambleAt + 32);
  }
  for (size_t s = 0; s < stripes % kStripesPerBlock; ++s, at += kStripe)
    stripe_avx2<kStore>(a0, a1, dst + at, src + at, kSecret + 8 * s);
  // The last stripe, loaded again at n - 64 and stored whole: its first bytes were stored
  // already. Were the source to change in between, both loads are in the sum, which then
  // matches the value's only if both were the value's bytes: the sum never vouches for
  // bytes that were not stored.
  stripe_avx2<Store::Plain>(a0, a1, dst + n - kStripe, src + n - kStripe, kSecret + kLastStripeAt);
  if constexpr (kStore != Store::Plain) _mm_sfence();  // weakly ordered: visible before we return
  alignas(32) uint64_t acc[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
  return merge_accs(acc, n);
}

// ---- AVX-512: the 8 lanes in one register ----

// GCC 12's avx512fintrin.h seeds its "undefined" vectors from themselves, which
// -W(maybe-)uninitialized reports wherever the intrinsics are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

GCACHE_AVX512 __m512i acc_avx512(__m512i acc, __m512i data, const uint8_t* key) {
  const __m512i data_key = _mm512_xor_si512(data, _mm512_loadu_si512(key));
  const __m512i product =
      _mm512_mul_epu32(data_key, _mm512_shuffle_epi32(data_key, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(0, 3, 0, 1))));
  return _mm512_add_epi64(
      product, _mm512_add_epi64(acc, _mm512_shuffle_epi32(data, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)))));
}

GCACHE_AVX512 __m512i scramble_avx512(__m512i acc, const uint8_t* key) {
  const __m512i prime = _mm512_set1_epi32(int(kPrime32_1));
  // acc ^ (acc >> 47) ^ key in one instruction (0x96: a ^ b ^ c)
  const __m512i data_key = _mm512_ternarylogic_epi32(acc, _mm512_srli_epi64(acc, 47), _mm512_loadu_si512(key), 0x96);
  const __m512i lo = _mm512_mul_epu32(data_key, prime);
  const __m512i hi =
      _mm512_mul_epu32(_mm512_shuffle_epi32(data_key, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(0, 3, 0, 1))), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

template <Store kStore>
GCACHE_AVX512 void stripe_avx512(__m512i& acc, uint8_t* dst, const uint8_t* src, const uint8_t* key) {
  const __m512i v = _mm512_loadu_si512(src);
  if constexpr (kStore == Store::StreamWide) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else if constexpr (kStore == Store::Stream16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm512_castsi512_si128(v));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_extracti32x4_epi32(v, 1));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), _mm512_extracti32x4_epi32(v, 2));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), _mm512_extracti32x4_epi32(v, 3));
  } else {
    _mm512_storeu_si512(dst, v);
  }
  acc = acc_avx512(acc, v, key);
}

template <Store kStore>
__attribute__((target("avx512f"))) uint64_t fused_avx512(uint8_t* dst, const uint8_t* src, size_t n) {
  __m512i a = _mm512_load_si512(kInitAcc);
  const size_t stripes = (n - 1) / kStripe;
  size_t at = 0;
  for (size_t b = 0; b < stripes / kStripesPerBlock; ++b) {
#pragma GCC unroll 16
    for (size_t s = 0; s < kStripesPerBlock; ++s, at += kStripe)
      stripe_avx512<kStore>(a, dst + at, src + at, kSecret + 8 * s);
    a = scramble_avx512(a, kSecret + kScrambleAt);
  }
  for (size_t s = 0; s < stripes % kStripesPerBlock; ++s, at += kStripe)
    stripe_avx512<kStore>(a, dst + at, src + at, kSecret + 8 * s);
  stripe_avx512<Store::Plain>(a, dst + n - kStripe, src + n - kStripe, kSecret + kLastStripeAt);  // as AVX2's
  if constexpr (kStore != Store::Plain) _mm_sfence();
  alignas(64) uint64_t acc[8];
  _mm512_store_si512(acc, a);
  return merge_accs(acc, n);
}

#pragma GCC diagnostic pop

// The widest non-temporal store the destination's alignment allows (`wide`: the register's size).
Store store_for(const uint8_t* dst, bool stream, uintptr_t wide) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (!stream) return Store::Plain;
  if (a % wide == 0) return Store::StreamWide;
  return a % 16 == 0 ? Store::Stream16 : Store::Plain;
}

uint64_t fused(CopyLevel level, uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
  if (level == CopyLevel::Avx512) {
    switch (store_for(dst, stream, 64)) {
      case Store::StreamWide: return fused_avx512<Store::StreamWide>(dst, src, n);
      case Store::Stream16: return fused_avx512<Store::Stream16>(dst, src, n);
      case Store::Plain: return fused_avx512<Store::Plain>(dst, src, n);
    }
  }
  switch (store_for(dst, stream, 32)) {
    case Store::StreamWide: return fused_avx2<Store::StreamWide>(dst, src, n);
    case Store::Stream16: return fused_avx2<Store::Stream16>(dst, src, n);
    case Store::Plain: break;
  }
  return fused_avx2<Store::Plain>(dst, src, n);
}

#endif  // GCACHE_X86

// The portable level (and every xxh64 value): chunk by chunk, while each chunk is in cache.
uint64_t copy_then_hash(ChecksumKind kind, HashSide side, uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
  ChecksumStream h(kind);
  for (size_t at = 0; at < n; at += kChunkBytes) {
    const size_t c = std::min(kChunkBytes, n - at);
    if (side == HashSide::Source) {
      h.update(src + at, c);  // now in cache: stream it out
      copy_bytes(dst + at, src + at, c, stream);
    } else {
      std::memcpy(dst + at, src + at, c);  // hashed from cache right after
      h.update(dst + at, c);
    }
  }
  return h.digest();
}

CopyLevel best_supported() {
  static const CopyLevel best = [] {
    if (copy_level_supported(CopyLevel::Avx512)) return CopyLevel::Avx512;
    if (copy_level_supported(CopyLevel::Avx2)) return CopyLevel::Avx2;
    return CopyLevel::Portable;
  }();
  return best;
}

bool level_named(const std::string& name, CopyLevel* out) {
  for (CopyLevel l : {CopyLevel::Portable, CopyLevel::Avx2, CopyLevel::Avx512})
    if (name == copy_level_name(l)) {
      *out = l;
      return true;
    }
  return false;
}

}  // namespace

const char* copy_level_name(CopyLevel level) {
  switch (level) {
    case CopyLevel::Portable: return "portable";
    case CopyLevel::Avx2: return "avx2";
    case CopyLevel::Avx512: return "avx512";
  }
  return "unknown";
}

bool copy_level_supported(CopyLevel level) {
#if GCACHE_X86
  __builtin_cpu_init();  // idempotent; needed if we run before the constructors
  switch (level) {
    case CopyLevel::Portable: return true;
    case CopyLevel::Avx2: return __builtin_cpu_supports("avx2");
    case CopyLevel::Avx512: return __builtin_cpu_supports("avx512f");
  }
  return false;
#else
  return level == CopyLevel::Portable;
#endif
}

CopyLevel copy_level() {
  static const CopyLevel chosen = [] {
    const CopyLevel best = best_supported();
    const char* env = std::getenv("GCACHE_COPY_LEVEL");
    CopyLevel asked;
    if (env == nullptr || !level_named(env, &asked)) return best;  // unset or unknown: the best
    return asked < best ? asked : best;
  }();
  return chosen;
}

void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
#if GCACHE_X86
  if (stream && n >= 64) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; ++i, dst += 64, src += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    _mm_sfence();  // streaming stores are weakly ordered: visible before we return
    n -= blocks * 64;
  }
#endif
  std::memcpy(dst, src, n);
}

uint64_t copy_and_checksum(ChecksumKind kind, HashSide side, uint8_t* dst, const uint8_t* src, size_t n, bool stream,
                           CopyLevel level) {
#if GCACHE_X86
  if (kind == ChecksumKind::Xxh3 && n > kShortMax && level != CopyLevel::Portable) {
    const CopyLevel best = best_supported();
    return fused(level < best ? level : best, dst, src, n, stream);
  }
#endif
  (void)level;
  return copy_then_hash(kind, side, dst, src, n, stream && side == HashSide::Source);
}

}  // namespace gcache

namespace py = pybind11;

void bind_xxh3_copy(py::module_& m) {
  m.def(
      "xxh3_copy",
      [](py::buffer dst, py::buffer src, const std::string& level, bool stream, bool hash_destination) {
        gcache::CopyLevel l = gcache::copy_level();
        if (!level.empty() && !gcache::level_named(level, &l)) throw py::value_error("unknown copy level: " + level);
        if (!gcache::copy_level_supported(l)) throw py::value_error("this CPU cannot run copy level " + level);
        py::buffer_info s = src.request(), d = dst.request(true);
        if (!PyBuffer_IsContiguous(s.view(), 'A') || !PyBuffer_IsContiguous(d.view(), 'A'))
          throw py::value_error("xxh3_copy needs contiguous buffers");
        const size_t n = size_t(s.size) * size_t(s.itemsize);
        if (size_t(d.size) * size_t(d.itemsize) < n) throw py::value_error("xxh3_copy: dst is smaller than src");
        const auto side = hash_destination ? gcache::HashSide::Destination : gcache::HashSide::Source;
        py::gil_scoped_release release;
        return gcache::copy_and_checksum(gcache::ChecksumKind::Xxh3, side, static_cast<uint8_t*>(d.ptr),
                                         static_cast<const uint8_t*>(s.ptr), n, stream, l);
      },
      py::arg("dst"), py::arg("src"), py::arg("level") = "", py::arg("stream") = false,
      py::arg("hash_destination") = false,
      "Copies src into the start of dst and returns XXH3-64 (no seed) of the bytes copied, in one pass at "
      "`level` (\"portable\", \"avx2\", \"avx512\"; empty: copy_level()). stream: non-temporal stores; "
      "hash_destination: the portable level hashes dst after the copy (a read) instead of src before it.");
  m.def(
      "copy_levels",
      [] {
        py::list out;
        for (gcache::CopyLevel l : {gcache::CopyLevel::Portable, gcache::CopyLevel::Avx2, gcache::CopyLevel::Avx512})
          if (gcache::copy_level_supported(l)) out.append(gcache::copy_level_name(l));
        return out;
      },
      "The copy levels this CPU can run, worst first.");
  m.def(
      "copy_level", [] { return gcache::copy_level_name(gcache::copy_level()); },
      "The level every copy with a checksum uses: the best supported, capped by GCACHE_COPY_LEVEL.");
}
