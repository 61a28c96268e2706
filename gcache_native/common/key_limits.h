// How long a stored key may be: the store checks it, the disk records and the
// warm list bound their scans by it, the server by the user part of it.
#pragma once

#include <cstdint>

namespace gcache {

// A client key is 1..512 bytes (docs/protocol.md); an authenticated node
// stores it behind its tenant's prefix (name + NUL, at most 33 bytes).
constexpr uint32_t kUserKeyBytesMax = 512;
constexpr uint32_t kTenantPrefixBytesMax = 33;
constexpr uint32_t kKeyBytesMax = kUserKeyBytesMax + kTenantPrefixBytesMax;

}  // namespace gcache
