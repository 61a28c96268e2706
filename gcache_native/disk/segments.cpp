#include "disk/segments.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "common/key_limits.h"

namespace gcache {

namespace {
std::string errno_text() { return strerror(errno); }

bool parse_segment_name(const char* name, uint32_t* id) {
  unsigned value = 0;
  char tail = 0;
  if (strlen(name) != 16 || sscanf(name, "seg-%8u.lo%c", &value, &tail) != 2 || tail != 'g') return false;
  *id = value;
  return true;
}

uint64_t file_size(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_size);
}
}  // namespace

SegmentFile::~SegmentFile() {
  if (fd >= 0) close(fd);
}

bool read_segment(const SegmentFile& file, uint64_t offset, uint64_t len, void* dest) {
  auto* out = static_cast<uint8_t*>(dest);
  while (len > 0) {
    ssize_t n = pread(file.fd, out, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    offset += static_cast<uint64_t>(n);
    len -= static_cast<uint64_t>(n);
  }
  return true;
}

DiskSegments::DiskSegments(const std::string& dir, uint64_t disk_bytes, uint64_t segment_bytes, Metrics* metrics)
    : dir_(dir), disk_bytes_(disk_bytes), segment_bytes_(segment_bytes ? segment_bytes : 1), metrics_(metrics) {
  if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
    throw std::runtime_error("cannot create data dir " + dir_ + ": " + errno_text());
  std::string lock_path = dir_ + "/LOCK";
  lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) throw std::runtime_error("cannot open " + lock_path + ": " + errno_text());
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    close(lock_fd_);
    lock_fd_ = -1;
    if (err == EWOULDBLOCK)
      throw std::runtime_error("data dir " + dir_ + " is in use by another gcache process (" + lock_path +
                               " is locked); stop it or choose another --data-dir");
    throw std::runtime_error("cannot lock " + lock_path + ": " + strerror(err));
  }
  DIR* listing = opendir(dir_.c_str());
  if (!listing) throw std::runtime_error("cannot list data dir " + dir_ + ": " + errno_text());
  while (dirent* item = readdir(listing)) {
    uint32_t id = 0;
    if (!parse_segment_name(item->d_name, &id)) continue;
    int fd = open(path_of(id).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      closedir(listing);
      throw std::runtime_error("cannot open segment " + path_of(id) + ": " + errno_text());
    }
    Segment segment;
    segment.file = std::make_shared<SegmentFile>();
    segment.file->fd = fd;
    segment.file->id = id;
    segment.bytes = file_size(fd);
    used_bytes_ += segment.bytes;
    segments_[id] = segment;
    if (id >= next_id_) next_id_ = id + 1;
  }
  closedir(listing);
}

DiskSegments::~DiskSegments() {
  segments_.clear();
  if (lock_fd_ >= 0) close(lock_fd_);  // closing releases the flock
}

std::string DiskSegments::path_of(uint32_t id) const {
  char name[32];
  snprintf(name, sizeof(name), "/seg-%08u.log", id);
  return dir_ + name;
}

void DiskSegments::scan(const std::function<void(const ScannedRecord&)>& visit) {
  std::vector<uint8_t> buffer(sizeof(RecordHeader) + kKeyBytesMax);
  for (auto& [id, segment] : segments_) {
    uint64_t offset = 0;
    while (offset < segment.bytes) {
      uint64_t want = std::min<uint64_t>(buffer.size(), segment.bytes - offset);
      bool sound = want >= sizeof(RecordHeader) && read_segment(*segment.file, offset, want, buffer.data());
      ScannedRecord record;
      if (sound) {
        memcpy(&record.header, buffer.data(), sizeof(RecordHeader));
        uint64_t key_len = record.header.key_len;
        sound = key_len <= kKeyBytesMax && sizeof(RecordHeader) + key_len <= want;
        if (sound) {
          record.key.assign(reinterpret_cast<const char*>(buffer.data() + sizeof(RecordHeader)), key_len);
          sound = record_header_valid(record.header, record.key) && record.header.value_len <= segment.bytes &&
                  offset + record_bytes(key_len, record.header.value_len) <= segment.bytes;
        }
      }
      if (!sound) {  // torn or garbage: nothing after it in this file can be trusted
        metrics_->torn_records_skipped.fetch_add(1, std::memory_order_relaxed);
        if (ftruncate(segment.file->fd, static_cast<off_t>(offset)) != 0)
          metrics_->disk_errors.fetch_add(1, std::memory_order_relaxed);
        used_bytes_ -= segment.bytes - offset;
        segment.bytes = offset;
        break;
      }
      record.location = {id, offset};
      visit(record);
      offset += record_bytes(record.header.key_len, record.header.value_len);
    }
  }
}

DiskSegments::Segment& DiskSegments::open_new_segment() {
  uint32_t id = next_id_++;
  int fd = open(path_of(id).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("cannot create segment " + path_of(id) + ": " + errno_text());
  Segment& segment = segments_[id];
  segment.file = std::make_shared<SegmentFile>();
  segment.file->fd = fd;
  segment.file->id = id;
  return segment;
}

bool DiskSegments::reserve(std::string_view key, uint64_t value_len, RecordLocation* out, SegmentFileRef* file) {
  uint64_t bytes = record_bytes(key.size(), value_len);
  if (used_bytes_ + bytes > disk_bytes_) throw std::logic_error("reserve: caller did not make room on disk");
  Segment* head = segments_.empty() ? nullptr : &segments_.rbegin()->second;
  try {
    if (!head || (head->bytes > 0 && head->bytes + bytes > segment_bytes_)) head = &open_new_segment();
  } catch (const std::exception&) {
    metrics_->disk_errors.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  out->segment = head->file->id;
  out->offset = head->bytes;
  *file = head->file;
  head->bytes += bytes;
  used_bytes_ += bytes;
  return true;
}

bool DiskSegments::write_record(const SegmentFile& file, const RecordLocation& at, uint8_t kind, std::string_view key,
                                const void* value, uint64_t value_len, const ValueChecksum& value_sum) {
  uint64_t bytes = record_bytes(key.size(), value_len);
  RecordHeader header = make_record_header(kind, key, value_len, value_sum);
  static const uint8_t kZeros[8] = {};
  uint64_t pad = bytes - sizeof(header) - key.size() - value_len;
  iovec parts[4] = {{&header, sizeof(header)},
                    {const_cast<char*>(key.data()), key.size()},
                    {const_cast<void*>(value), value_len},
                    {const_cast<uint8_t*>(kZeros), pad}};
  uint64_t written = 0;
  int first = 0;
  while (written < bytes) {  // pwritev may write short; resume where it stopped
    ssize_t n = pwritev(file.fd, parts + first, 4 - first, static_cast<off_t>(at.offset + written));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    written += static_cast<uint64_t>(n);
    uint64_t advance = static_cast<uint64_t>(n);
    while (first < 4 && advance >= parts[first].iov_len) advance -= parts[first++].iov_len;
    if (first < 4) {
      parts[first].iov_base = static_cast<uint8_t*>(parts[first].iov_base) + advance;
      parts[first].iov_len -= advance;
    }
  }
  return true;
}

void DiskSegments::cancel(const RecordLocation& at, uint64_t bytes) {
  metrics_->disk_errors.fetch_add(1, std::memory_order_relaxed);
  auto it = segments_.find(at.segment);
  if (it == segments_.end() || it->second.bytes != at.offset + bytes)
    throw std::logic_error("cancel: the record is not the last one of its segment");
  if (ftruncate(it->second.file->fd, static_cast<off_t>(at.offset)) != 0) { /* check() reports the size */
  }
  it->second.bytes = at.offset;
  used_bytes_ -= bytes;
}

bool DiskSegments::append(uint8_t kind, std::string_view key, const void* value, uint64_t value_len,
                          const ValueChecksum& value_sum, RecordLocation* out) {
  SegmentFileRef file;
  if (!reserve(key, value_len, out, &file)) return false;
  if (write_record(*file, *out, kind, key, value, value_len, value_sum)) return true;
  cancel(*out, record_bytes(key.size(), value_len));
  return false;
}

SegmentFileRef DiskSegments::drop(uint32_t id) {
  auto it = segments_.find(id);
  if (it == segments_.end()) return nullptr;
  SegmentFileRef file = it->second.file;
  if (unlink(path_of(id).c_str()) != 0) metrics_->disk_errors.fetch_add(1, std::memory_order_relaxed);
  used_bytes_ -= it->second.bytes;
  segments_.erase(it);
  metrics_->segments_reclaimed.fetch_add(1, std::memory_order_relaxed);
  return file;
}

SegmentFileRef DiskSegments::file(uint32_t id) const {
  auto it = segments_.find(id);
  return it == segments_.end() ? nullptr : it->second.file;
}

bool DiskSegments::oldest(uint32_t* id) const {
  if (segments_.empty()) return false;
  *id = segments_.begin()->first;
  return true;
}

uint64_t DiskSegments::segment_size(uint32_t id) const {
  auto it = segments_.find(id);
  return it == segments_.end() ? 0 : it->second.bytes;
}

void DiskSegments::sync_all() {
  for (auto& [id, segment] : segments_)
    if (fsync(segment.file->fd) != 0) metrics_->disk_errors.fetch_add(1, std::memory_order_relaxed);
  int dir_fd = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
}

void DiskSegments::check() const {
  uint64_t sum = 0;
  for (auto& [id, segment] : segments_) {
    uint64_t actual = file_size(segment.file->fd);
    if (actual != segment.bytes)
      throw std::logic_error("disk: segment " + std::to_string(id) + " is " + std::to_string(actual) +
                             " bytes on disk but tracked as " + std::to_string(segment.bytes));
    sum += actual;
  }
  if (sum != used_bytes_) throw std::logic_error("disk: used byte count drifted");
  if (sum > disk_bytes_) throw std::logic_error("disk: segments use more than disk_bytes");
}

}  // namespace gcache
