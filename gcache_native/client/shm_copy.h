// The one-sided copy kernel (client/shm_copy.cpp): copies between a mapped
// arena and caller buffers, each value's checksum computed in the same pass,
// across a persistent bounded thread pool for large batches. Shared by the
// Python-facing shm_* helpers and the native client core (client/core_shm.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/checksum.h"

namespace gcache::shm_copy {

struct CopyItem {
  const uint8_t* src;
  uint8_t* dst;
  uint64_t length;
  uint64_t expected;  // checksum to compare (reads)
  ChecksumKind kind = kChecksumKindNew;
  uint64_t sum = 0;  // checksum of the bytes copied
};

// Source: hash the caller's bytes just before copying them (writes);
// Destination: hash what was copied out (reads); None: copy only.
enum class Hash { None, Source, Destination };

// Copies every item (threads 0 = by size, up to the cores); sets each item's sum unless Hash::None.
// Never throws; needs no GIL.
void run_items(std::vector<CopyItem>& items, int threads, Hash hash);

size_t copy_pool_threads();

}  // namespace gcache::shm_copy
