// The disk tier's files: append-only segments `seg-NNNNNNNN.log` in one data
// dir, whose total size stays <= disk_bytes. Owns the dir lock (flock on
// DATA_DIR/LOCK). Knows records, not the index: the Store decides what to
// reclaim and what to copy forward. Not thread-safe (the Store locks it);
// reads through a FileRef need no lock and survive the segment being dropped.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics.h"
#include "disk/record.h"

namespace gcache {

struct SegmentFile {
  int fd = -1;
  uint32_t id = 0;
  ~SegmentFile();
};
using SegmentFileRef = std::shared_ptr<const SegmentFile>;

struct RecordLocation {
  uint32_t segment = 0;
  uint64_t offset = 0;  // of the record header
};

struct ScannedRecord {
  RecordLocation location;
  RecordHeader header;
  std::string key;
};

class DiskSegments {
 public:
  // Creates the dir if needed and locks it; throws std::runtime_error if
  // another process holds it or it cannot be used.
  DiskSegments(const std::string& dir, uint64_t disk_bytes, uint64_t segment_bytes, Metrics* metrics);
  ~DiskSegments();

  // Visits every sound record in segment order. A record that is cut short or
  // fails its header checksum ends its segment: the file is truncated there
  // and torn_records_skipped counts it.
  void scan(const std::function<void(const ScannedRecord&)>& visit);

  // Appends one record at the head, rolling to a new segment when the head
  // would pass segment_bytes. The caller must have made room first
  // (used_bytes() + record_bytes(...) <= disk_bytes()). False on IO error.
  bool append(uint8_t kind, std::string_view key, const void* value, uint64_t value_len, const ValueChecksum& value_sum,
              RecordLocation* out);

  // The same in three steps, so the bytes can be written without the Store's
  // lock: reserve() places the record at the tail (making room is still the
  // caller's job), write_record() needs no lock, and cancel() takes a failed
  // record back off the tail. The caller serializes reserve..cancel, so a
  // reserved record is always the last one and a crash can only tear the tail.
  bool reserve(std::string_view key, uint64_t value_len, RecordLocation* out, SegmentFileRef* file);
  static bool write_record(const SegmentFile& file, const RecordLocation& at, uint8_t kind, std::string_view key,
                           const void* value, uint64_t value_len, const ValueChecksum& value_sum);
  void cancel(const RecordLocation& at, uint64_t bytes);

  // Unlinks a segment; the returned file stays readable until released.
  SegmentFileRef drop(uint32_t id);
  SegmentFileRef file(uint32_t id) const;

  // Oldest segment id, or false when there is none.
  bool oldest(uint32_t* id) const;
  uint64_t segment_size(uint32_t id) const;
  size_t segment_count() const { return segments_.size(); }
  uint64_t used_bytes() const { return used_bytes_; }
  uint64_t disk_bytes() const { return disk_bytes_; }
  const std::string& dir() const { return dir_; }

  // fsyncs every segment and the dir (warm shutdown).
  void sync_all();

  // Throws std::logic_error unless tracked sizes match the files and their
  // sum stays within disk_bytes.
  void check() const;

 private:
  struct Segment {
    std::shared_ptr<SegmentFile> file;
    uint64_t bytes = 0;
  };
  std::string path_of(uint32_t id) const;
  Segment& open_new_segment();

  std::string dir_;
  uint64_t disk_bytes_;
  uint64_t segment_bytes_;
  Metrics* metrics_;
  int lock_fd_ = -1;
  std::map<uint32_t, Segment> segments_;
  uint32_t next_id_ = 1;
  uint64_t used_bytes_ = 0;
};

// Reads `len` bytes at `offset` of a segment; false on a short read or error.
bool read_segment(const SegmentFile& file, uint64_t offset, uint64_t len, void* dest);

}  // namespace gcache
