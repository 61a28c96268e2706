#include "store/warm_list.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "common/checksum.h"
#include "store/store.h"

namespace gcache {

namespace {
constexpr char kMagic[8] = {'G', 'C', 'W', 'A', 'R', 'M', '0', '1'};
constexpr uint64_t kItemsMax = 1ull << 26;

void put_bytes(std::string* out, const void* p, size_t n) { out->append(static_cast<const char*>(p), n); }

bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}
}  // namespace

bool write_warm_list(const std::string& path, const std::vector<WarmItem>& items) {
  std::string data;
  put_bytes(&data, kMagic, sizeof(kMagic));
  uint64_t count = items.size();
  put_bytes(&data, &count, sizeof(count));
  for (auto& item : items) {
    uint16_t key_len = static_cast<uint16_t>(item.key.size());
    put_bytes(&data, &item.queue, 1);
    put_bytes(&data, &item.freq, 1);
    put_bytes(&data, &key_len, 2);
    data += item.key;
  }
  uint64_t sum = xxh64(data.data(), data.size());
  put_bytes(&data, &sum, sizeof(sum));
  std::string tmp = path + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = write_all(fd, data) && fsync(fd) == 0;
  close(fd);
  return ok && rename(tmp.c_str(), path.c_str()) == 0;
}

std::vector<WarmItem> read_warm_list(const std::string& path) {
  std::vector<WarmItem> items;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return items;
  std::string data;
  char buffer[1 << 16];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) data.append(buffer, static_cast<size_t>(n));
  close(fd);
  if (data.size() < sizeof(kMagic) + 16 || memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) return items;
  uint64_t sum;
  memcpy(&sum, data.data() + data.size() - 8, 8);
  if (xxh64(data.data(), data.size() - 8) != sum) return items;
  uint64_t count;
  memcpy(&count, data.data() + 8, 8);
  if (count > kItemsMax) return items;
  size_t at = 16, end = data.size() - 8;
  for (uint64_t i = 0; i < count; ++i) {
    if (at + 4 > end) return {};
    WarmItem item;
    item.queue = static_cast<uint8_t>(data[at]);
    item.freq = static_cast<uint8_t>(data[at + 1]);
    uint16_t key_len;
    memcpy(&key_len, data.data() + at + 2, 2);
    at += 4;
    if (key_len == 0 || key_len > kKeyBytesMax || at + key_len > end) return {};
    item.key.assign(data.data() + at, key_len);
    at += key_len;
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace gcache
