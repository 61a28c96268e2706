// The warm list: which keys were in memory at a warm shutdown, hottest first,
// so the next open reloads them from disk into the arena. A missing, torn or
// corrupt list is ignored (the store just starts cold).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gcache {

struct WarmItem {
  std::string key;
  uint8_t queue = 0;  // QueueId
  uint8_t freq = 0;
};

// Writes to path.tmp, fsyncs, renames over path. False on IO error.
bool write_warm_list(const std::string& path, const std::vector<WarmItem>& items);
std::vector<WarmItem> read_warm_list(const std::string& path);

}  // namespace gcache
