// Who a value belongs to (tenants): the index entries, the eviction policies
// and the Store's quotas all name owners by this id.
#pragma once

#include <cstdint>

namespace gcache {

using OwnerId = uint32_t;  // who a value belongs to (tenants); 0 = the default owner
constexpr OwnerId kAnyOwner = UINT32_MAX;

}  // namespace gcache
