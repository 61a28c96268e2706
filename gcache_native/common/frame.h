// The 32-byte frame header of docs/protocol.md: parse and build.
#pragma once

#include <cstdint>
#include <cstring>

namespace gcache {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

constexpr uint32_t kFrameHeaderBytes = 32;
constexpr uint8_t kProtocolVersion = 1;
constexpr uint16_t kFlagResponse = 1;
constexpr uint16_t kFlagNoReply = 2;  // on a RELEASE request: the server sends no answer
constexpr char kFrameMagic[4] = {'G', 'C', 'H', '1'};

enum class Opcode : uint8_t {
  Ping = 1,
  Stats = 2,
  PutBatch = 3,
  GetBatch = 4,
  ExistsBatch = 5,
  RemoveBatch = 6,
  Auth = 7,  // challenge-response handshake (docs/protocol.md, "Authentication")
  // One-sided access to the arena (docs/protocol.md, "Shared memory and RDMA").
  ShmAttach = 8,     // the arena's memfd, passed with SCM_RIGHTS (Unix socket only)
  Lookup = 9,        // per key: offset, length, xxh64, under one lease
  Release = 10,      // drops leases and reservations
  Reserve = 11,      // arena blocks to write new values into
  Commit = 12,       // publishes reserved blocks (checksums verified)
  RdmaConnect = 13,  // queue-pair setup, answered by the RDMA handler (gcache.server.rdma)
};
constexpr uint8_t kOpcodeMax = 13;

enum class FrameStatus : uint32_t {
  Ok = 0,
  BadFrame = 1,
  UnknownOpcode = 2,
  LimitExceeded = 3,
  BadVersion = 4,
  Busy = 5,
  ShuttingDown = 6,
  Internal = 7,
  StaleEpoch = 8,       // the request's cluster-map epoch is older than the node's
  Unauthenticated = 9,  // no (or a failed) AUTH on a node that requires it; the connection is closed
  Forbidden = 10,       // the tenant's roles do not allow this opcode; the connection stays open
};

inline const char* frame_status_name(FrameStatus s) {
  switch (s) {
    case FrameStatus::Ok: return "OK";
    case FrameStatus::BadFrame: return "BAD_FRAME";
    case FrameStatus::UnknownOpcode: return "UNKNOWN_OPCODE";
    case FrameStatus::LimitExceeded: return "LIMIT_EXCEEDED";
    case FrameStatus::BadVersion: return "BAD_VERSION";
    case FrameStatus::Busy: return "BUSY";
    case FrameStatus::ShuttingDown: return "SHUTTING_DOWN";
    case FrameStatus::Internal: return "INTERNAL";
    case FrameStatus::StaleEpoch: return "STALE_EPOCH";
    case FrameStatus::Unauthenticated: return "UNAUTHENTICATED";
    case FrameStatus::Forbidden: return "FORBIDDEN";
  }
  return "UNKNOWN";
}

struct FrameHeader {
  char magic[4];
  uint8_t version;
  uint8_t opcode;
  uint16_t flags;
  uint64_t request_id;
  uint32_t meta_len;
  uint32_t status;
  uint64_t payload_len;
};
static_assert(sizeof(FrameHeader) == kFrameHeaderBytes, "header layout must match the wire");

inline FrameHeader parse_frame_header(const uint8_t* bytes) {
  FrameHeader h;
  std::memcpy(&h, bytes, kFrameHeaderBytes);
  return h;
}

inline bool frame_magic_ok(const FrameHeader& h) { return std::memcmp(h.magic, kFrameMagic, 4) == 0; }

inline void build_frame_header(uint8_t* out, uint8_t opcode, uint16_t flags, uint64_t request_id, uint32_t meta_len,
                               FrameStatus status, uint64_t payload_len) {
  FrameHeader h;
  std::memcpy(h.magic, kFrameMagic, 4);
  h.version = kProtocolVersion;
  h.opcode = opcode;
  h.flags = flags;
  h.request_id = request_id;
  h.meta_len = meta_len;
  h.status = static_cast<uint32_t>(status);
  h.payload_len = payload_len;
  std::memcpy(out, &h, kFrameHeaderBytes);
}

}  // namespace gcache
