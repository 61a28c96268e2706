// The memory tier's backing store: one shared-memory mapping (memfd, or an
// unlinked file in /dev/shm when memfd_create is unavailable) so same-host
// readers can map it read-only through arena_fd().
#pragma once

#include <cstdint>

namespace gcache {

class SharedArena {
 public:
  explicit SharedArena(uint64_t bytes);  // throws std::runtime_error
  ~SharedArena();
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  int fd() const { return fd_; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  int fd_ = -1;
};

}  // namespace gcache
