// GCACHE_ASSERT(cond): an invariant check that costs nothing in a release
// build. With -DGCACHE_DEBUG (GCACHE_NATIVE_DEBUG=1 at build time, see
// setup.py) a false condition throws std::logic_error naming the condition
// and where it is, so a broken invariant fails the operation (and the test
// that ran it) at the point it broke rather than later. The condition must
// have no side effects: a release build does not evaluate it.
#pragma once

#ifdef GCACHE_DEBUG
#include <stdexcept>
#include <string>

namespace gcache {
[[noreturn]] inline void assert_failed(const char* condition, const char* file, int line) {
  throw std::logic_error(std::string("GCACHE_ASSERT failed: ") + condition + " at " + file + ":" +
                         std::to_string(line));
}
}  // namespace gcache

#define GCACHE_ASSERT(cond) ((cond) ? void(0) : ::gcache::assert_failed(#cond, __FILE__, __LINE__))
#define GCACHE_DEBUG_ONLY(...) __VA_ARGS__
#else
#define GCACHE_ASSERT(cond) ((void)0)
#define GCACHE_DEBUG_ONLY(...)
#endif
