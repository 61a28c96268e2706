// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104): the data port's
// challenge-response authentication. Small and dependency-free, so the node
// needs no crypto library; tests check it against Python's hashlib/hmac.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace gcache {

using Sha256Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  void update(std::string_view s) { update(s.data(), s.size()); }
  Sha256Digest finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

Sha256Digest sha256(std::string_view data);
Sha256Digest hmac_sha256(std::string_view key, std::string_view message);

// Equal-length comparison whose time does not depend on where bytes differ.
bool constant_time_equal(const uint8_t* a, const uint8_t* b, size_t len);

}  // namespace gcache
