#include "common/arena_shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gcache {

namespace {
int open_dev_shm_file() {
  char path[] = "/dev/shm/gcache-arena-XXXXXX";
  int fd = mkostemp(path, O_CLOEXEC);
  if (fd >= 0) unlink(path);  // the mapping lives on through the fd
  return fd;
}
}  // namespace

SharedArena::SharedArena(uint64_t bytes) : bytes_(bytes) {
  fd_ = memfd_create("gcache-arena", MFD_CLOEXEC);
  if (fd_ < 0) fd_ = open_dev_shm_file();
  if (fd_ < 0)
    throw std::runtime_error(std::string("cannot create the memory arena (memfd and /dev/shm both failed): ") +
                             strerror(errno));
  if (bytes_ == 0) return;
  if (ftruncate(fd_, (off_t)bytes_) != 0) {
    int err = errno;
    close(fd_);
    throw std::runtime_error("cannot size the memory arena to " + std::to_string(bytes_) + " bytes: " + strerror(err));
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd_);
    throw std::runtime_error("cannot map the memory arena (" + std::to_string(bytes_) + " bytes): " + strerror(err));
  }
  base_ = static_cast<uint8_t*>(p);
}

SharedArena::~SharedArena() {
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace gcache
