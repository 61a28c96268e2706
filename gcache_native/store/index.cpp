#include "store/index.h"

namespace gcache {

Index::~Index() {
  for (auto& kv : map_) delete kv.second;
  for (Entry* e : doomed_) delete e;
  for (Entry* e : retired_) delete e;
}

void Index::end_flush() {
  if (--flushes_running_ > 0) return;
  for (Entry* e : retired_) delete e;
  retired_.clear();
}

}  // namespace gcache
