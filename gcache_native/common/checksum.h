// Value checksums, from the xxHash library (libxxhash): XXH3-64 for every new
// value, XXH64 for values written by older clients and nodes. Which one a sum
// is travels with it (ChecksumKind: on the wire as "ck", per value in the
// store, per record on disk), so an old value is still verified by its own.
#pragma once
#include <cstddef>
#include <cstdint>

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t / XXH64_state_t by value
#include <xxhash.h>

namespace gcache {

// The contract: the numbers are on the wire and on disk; never renumber.
enum class ChecksumKind : uint8_t {
  Xxh64 = 0,  // XXH64, seed 0: what nodes and clients before XXH3 speak (and what "ck" absent means)
  Xxh3 = 1,   // XXH3_64bits, no seed: every new value
};
constexpr ChecksumKind kChecksumKindNew = ChecksumKind::Xxh3;
constexpr uint8_t kChecksumKindsSpoken = 2;  // 0 .. kChecksumKindsSpoken - 1

inline bool checksum_kind_valid(uint64_t k) { return k < kChecksumKindsSpoken; }
const char* checksum_kind_name(ChecksumKind k);

// A value's checksum as its writer declared it, and which algorithm it is.
struct ValueChecksum {
  uint64_t sum = 0;
  ChecksumKind kind = kChecksumKindNew;
};

uint64_t xxh64(const void* data, size_t length, uint64_t seed = 0);
uint64_t xxh3(const void* data, size_t length);  // AVX2 / AVX-512 when the CPU has them
uint64_t checksum_of(ChecksumKind kind, const void* data, size_t length);

// Streaming form, for values that arrive (or are copied) in pieces.
class ChecksumStream {
 public:
  explicit ChecksumStream(ChecksumKind kind);
  void update(const void* data, size_t length);
  uint64_t digest() const;
  ChecksumKind kind() const { return kind_; }

 private:
  ChecksumKind kind_;
  XXH3_state_t xxh3_;
  XXH64_state_t xxh64_;
};

}  // namespace gcache
