// Recycled heap nodes for a node-based container (std::map, std::unordered_map)
// that inserts and erases one element per put, get or remove: a freed node
// waits on a stack for the next insert instead of going back to malloc. With
// payload copies flushing the caches between requests, malloc's own free lists
// (a pointer read from every cold chunk, coalescing, malloc_consolidate) cost
// more than the container's work. Not thread-safe: the owner's lock guards it,
// as it guards the container.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace gcache {

// The freed blocks of one size (the container's node), at most `kept_max`
// (never more than the container held at once).
class NodePool {
 public:
  explicit NodePool(size_t kept_max) : kept_max_(kept_max) { free_.reserve(kept_max); }  // give() never allocates
  NodePool(const NodePool&) = delete;
  NodePool& operator=(const NodePool&) = delete;
  ~NodePool() {
    for (void* p : free_) ::operator delete(p);
  }

  void* take(size_t bytes) {
    if (bytes == node_bytes_ && !free_.empty()) {
      void* p = free_.back();
      free_.pop_back();
      return p;
    }
    if (node_bytes_ == 0) node_bytes_ = bytes;  // the first single node names the size
    return ::operator new(bytes);
  }
  void give(void* p, size_t bytes) {
    if (bytes == node_bytes_ && free_.size() < kept_max_) {
      free_.push_back(p);
      return;
    }
    ::operator delete(p);
  }
  size_t kept() const { return free_.size(); }

 private:
  size_t kept_max_;
  size_t node_bytes_ = 0;
  std::vector<void*> free_;
};

// An allocator whose single-object allocations (a container's nodes) go
// through a NodePool; arrays (an unordered_map's buckets) go to the heap. The
// pool must outlive every container using it.
template <class T>
struct PoolAllocator {
  using value_type = T;
  NodePool* pool;

  explicit PoolAllocator(NodePool* p) noexcept : pool(p) {}
  template <class U>
  PoolAllocator(const PoolAllocator<U>& other) noexcept : pool(other.pool) {}

  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "a pooled node comes from plain operator new");

  T* allocate(size_t n) {
    if (n == 1) return static_cast<T*>(pool->take(sizeof(T)));
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n == 1) pool->give(p, sizeof(T));
    else std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const PoolAllocator<U>& other) const noexcept {
    return pool == other.pool;
  }
  template <class U>
  bool operator!=(const PoolAllocator<U>& other) const noexcept {
    return pool != other.pool;
  }
};

}  // namespace gcache
