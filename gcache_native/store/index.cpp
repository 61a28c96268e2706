#include "store/index.h"

namespace gcache {

Index::~Index() {
  for (auto& kv : map_) delete kv.second;
  for (Entry* e : doomed_) delete e;
  for (Entry* e : retired_) delete e;
  for (Entry* e : spare_) delete e;
}

void Index::end_flush() {
  if (--flushes_running_ > 0) return;
  for (Entry* e : retired_) recycle(e);
  retired_.clear();
}

Entry* Index::make_entry() {
  if (spare_.empty()) return new Entry;
  Entry* e = spare_.back();
  spare_.pop_back();
  return e;
}

void Index::recycle(Entry* e) {
  if (spare_.size() >= kSpareEntriesMax) {
    delete e;
    return;
  }
  std::string key = std::move(e->key);  // its buffer goes on to the next key
  key.clear();
  *e = Entry();
  e->key = std::move(key);
  spare_.push_back(e);
}

}  // namespace gcache
