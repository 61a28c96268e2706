// On-disk record format of the disk tier. Each record describes itself so the
// index can be rebuilt by scanning segments:
//   RecordHeader (32 B) | key (key_len B) | value (value_len B) | zero pad to 8 B
// header_checksum = xxh64(first 24 header bytes + key); value_checksum =
// the value's checksum of kind checksum_kind (ChecksumKind: 0 xxh64, what
// records before XXH3 hold in that byte, then always 0; 1 xxh3), verified on
// every read. A tombstone has no value and deletes every earlier record of
// its key.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/checksum.h"

namespace gcache {

constexpr uint32_t kRecordMagic = 0x31524347;  // "GCR1" little-endian
constexpr uint8_t kRecordValue = 1;
constexpr uint8_t kRecordTombstone = 2;

#pragma pack(push, 1)
struct RecordHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t checksum_kind;  // of value_checksum (ChecksumKind); was a reserved 0
  uint16_t key_len;
  uint64_t value_len;
  uint64_t value_checksum;
  uint64_t header_checksum;
};
#pragma pack(pop)
static_assert(sizeof(RecordHeader) == 32, "record header is 32 bytes on disk");

inline uint64_t record_bytes(uint64_t key_len, uint64_t value_len) {
  return (sizeof(RecordHeader) + key_len + value_len + 7) / 8 * 8;
}

RecordHeader make_record_header(uint8_t kind, std::string_view key, uint64_t value_len, const ValueChecksum& value_sum);

// True when magic, kind, key length and header checksum are all sound.
bool record_header_valid(const RecordHeader& header, std::string_view key);

}  // namespace gcache
