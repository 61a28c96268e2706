// One step of a bounded spin: a thread polling without blocking for bytes it expects within
// microseconds (the client core's wait for a quick answer, a server connection's wait for
// the next small request). sched_yield() hands the core to any other runnable thread first,
// so a spinner never holds a core that the peer it waits for (or anyone else) needs on a busy
// machine; on an idle core it returns at once.
#pragma once

#include <sched.h>

namespace gcache {

inline void spin_step() { sched_yield(); }

}  // namespace gcache
