// A copy with its value checksum computed in the same pass: the fused XXH3 copy
// kernel. Per 64-byte stripe it loads the source into vector registers, stores
// them to the destination and feeds the same registers into XXH3's
// accumulators, so each byte is read once and the result is exactly
// XXH3_64bits(data, len) (no seed, the default secret) of the bytes loaded,
// which are the bytes stored. AVX2 and AVX-512 builds of the kernel are chosen
// at run time by the CPU; elsewhere (and for xxh64 values) the portable level
// copies then hashes each 64 KiB chunk while it is in cache, as before.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/checksum.h"

namespace gcache {

// The contract: the order is "better"; never renumber (tests force each by name).
enum class CopyLevel : uint8_t {
  Portable = 0,  // copy, then XXH3 of each chunk (libxxhash's own dispatch)
  Avx2 = 1,      // fused, 2 x 32-byte registers per stripe
  Avx512 = 2,    // fused, 1 x 64-byte register per stripe
};
const char* copy_level_name(CopyLevel level);
bool copy_level_supported(CopyLevel level);  // this CPU (and this build) can run it
// The best supported level, capped by GCACHE_COPY_LEVEL (portable | avx2 | avx512) when
// set: read once per process.
CopyLevel copy_level();

// Which bytes the portable level hashes (a fused level hashes the registers it
// stores, the same bytes for both): a read hashes what it copied out (what the
// caller gets), a write the caller's bytes just before they are copied.
enum class HashSide : uint8_t { Source, Destination };

// Copies n bytes; `stream`: non-temporal stores (bypass the cache) for the bulk.
void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, bool stream);

// Copies n bytes (src and dst must not overlap) and returns the checksum of
// `kind` of the bytes copied. XXH3 runs fused at `level` (at most the best
// supported); xxh64 always copies then hashes. `stream` asks for non-temporal
// stores where the destination allows them (never for the portable level's
// Destination side, which reads the stored bytes right back). Needs no GIL.
uint64_t copy_and_checksum(ChecksumKind kind, HashSide side, uint8_t* dst, const uint8_t* src, size_t n, bool stream,
                           CopyLevel level);
inline uint64_t copy_and_checksum(ChecksumKind kind, HashSide side, uint8_t* dst, const uint8_t* src, size_t n,
                                  bool stream) {
  return copy_and_checksum(kind, side, dst, src, n, stream, copy_level());
}

}  // namespace gcache
