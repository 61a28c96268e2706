#include "disk/record.h"

#include "common/checksum.h"
#include "common/key_limits.h"

namespace gcache {

namespace {
uint64_t header_checksum_of(const RecordHeader& header, std::string_view key) {
  ChecksumStream stream(ChecksumKind::Xxh64);  // headers stay xxh64: old and new records alike
  stream.update(&header, offsetof(RecordHeader, header_checksum));
  stream.update(key.data(), key.size());
  return stream.digest();
}
}  // namespace

RecordHeader make_record_header(uint8_t kind, std::string_view key, uint64_t value_len,
                                const ValueChecksum& value_sum) {
  RecordHeader header{};
  header.magic = kRecordMagic;
  header.kind = kind;
  header.key_len = static_cast<uint16_t>(key.size());
  header.value_len = value_len;
  header.checksum_kind = uint8_t(value_sum.kind);
  header.value_checksum = value_sum.sum;
  header.header_checksum = header_checksum_of(header, key);
  return header;
}

bool record_header_valid(const RecordHeader& header, std::string_view key) {
  if (header.magic != kRecordMagic) return false;
  if (header.kind != kRecordValue && header.kind != kRecordTombstone) return false;
  if (header.key_len == 0 || header.key_len > kKeyBytesMax || header.key_len != key.size()) return false;
  if (header.kind == kRecordTombstone && header.value_len != 0) return false;
  return header.header_checksum == header_checksum_of(header, key);
}

}  // namespace gcache
