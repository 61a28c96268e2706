#include "common/checksum.h"

#include <cstring>

#include <pybind11/pybind11.h>

namespace gcache {
namespace {
constexpr uint64_t P1 = 11400714785074694791ull;
constexpr uint64_t P2 = 14029467366897019727ull;
constexpr uint64_t P3 = 1609587929392839161ull;
constexpr uint64_t P4 = 9650029242287828579ull;
constexpr uint64_t P5 = 2870177450012600261ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
// Not reformatted: one-line helpers.
// clang-format off
inline uint64_t read64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t read32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
// clang-format on
inline uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}
inline uint64_t merge(uint64_t acc, uint64_t val) {
  acc ^= round(0, val);
  return acc * P1 + P4;
}

uint64_t finish(uint64_t h, const uint8_t* p, size_t len) {
  // Not reformatted: xxh64's tail, one step per line would hide its shape.
  // clang-format off
  while (len >= 8) { h ^= round(0, read64(p)); h = rotl(h, 27) * P1 + P4; p += 8; len -= 8; }
  if (len >= 4) { h ^= uint64_t(read32(p)) * P1; h = rotl(h, 23) * P2 + P3; p += 4; len -= 4; }
  while (len > 0) { h ^= (*p) * P5; h = rotl(h, 11) * P1; ++p; --len; }
  h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
  // clang-format on
  return h;
}

uint64_t converge(const uint64_t v[4]) {
  uint64_t h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
  for (int i = 0; i < 4; ++i) h = merge(h, v[i]);
  return h;
}
}  // namespace

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const size_t total = len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v[4] = {seed + P1 + P2, seed + P2, seed, seed - P1};
    while (len >= 32) {
      v[0] = round(v[0], read64(p));
      v[1] = round(v[1], read64(p + 8));
      v[2] = round(v[2], read64(p + 16));
      v[3] = round(v[3], read64(p + 24));
      p += 32;
      len -= 32;
    }
    h = converge(v);
  } else {
    h = seed + P5;
  }
  h += total;
  return finish(h, p, len);
}

Xxh64Stream::Xxh64Stream(uint64_t seed) : seed_(seed) {
  v_[0] = seed + P1 + P2;
  v_[1] = seed + P2;
  v_[2] = seed;
  v_[3] = seed - P1;
}

void Xxh64Stream::update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += len;
  if (buffered_ + len < 32) {
    std::memcpy(buffer_ + buffered_, p, len);
    buffered_ += len;
    return;
  }
  if (buffered_ > 0) {
    size_t fill = 32 - buffered_;
    std::memcpy(buffer_ + buffered_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(buffer_ + 8 * i));
    p += fill;
    len -= fill;
    buffered_ = 0;
  }
  while (len >= 32) {
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
    p += 32;
    len -= 32;
  }
  std::memcpy(buffer_, p, len);
  buffered_ = len;
}

uint64_t Xxh64Stream::digest() const {
  uint64_t h = total_ >= 32 ? converge(v_) : seed_ + P5;
  h += total_;
  return finish(h, buffer_, buffered_);
}

}  // namespace gcache

namespace py = pybind11;

void bind_checksum(py::module_& m) {
  m.def(
      "xxh64",
      [](py::buffer data, uint64_t seed) {
        py::buffer_info info = data.request();
        if (!PyBuffer_IsContiguous(info.view(), 'A')) throw py::value_error("xxh64 needs a contiguous buffer");
        const size_t n = size_t(info.size) * size_t(info.itemsize);
        py::gil_scoped_release release;
        return gcache::xxh64(info.ptr, n, seed);
      },
      py::arg("data"), py::arg("seed") = 0,
      "xxHash64 of any contiguous buffer (bytes, bytearray, memoryview, numpy array).");
}
