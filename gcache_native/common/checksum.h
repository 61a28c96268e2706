// xxHash64 (the XXH64 algorithm by Yann Collet), the checksum of every value.
#pragma once
#include <cstddef>
#include <cstdint>

namespace gcache {
uint64_t xxh64(const void* data, size_t length, uint64_t seed = 0);

// Streaming form, for values that arrive in pieces.
class Xxh64Stream {
 public:
  explicit Xxh64Stream(uint64_t seed = 0);
  void update(const void* data, size_t length);
  uint64_t digest() const;

 private:
  uint64_t v_[4];
  uint64_t total_ = 0;
  uint8_t buffer_[32];
  size_t buffered_ = 0;
  uint64_t seed_;
};
}  // namespace gcache
