// Keyed functions over a group's 16-byte secret: SipHash-2-4 (Aumasson and
// Bernstein, "SipHash: a fast short-input PRF", 2012), written from the paper,
// and a keyed 64-bit permutation built on it. Peers that share the secret
// agree on both; a process without it can neither forge a MAC nor guess a tag.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pz::keyed {

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// SipHash-2-4 of data[0, n) under a 128-bit key (two rounds per word, four to finish).
inline uint64_t siphash24(const uint8_t key[16], const void* data, size_t n) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  const uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
  uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
  uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
  auto round = [&] {
    v0 += v1, v1 = rotl(v1, 13), v1 ^= v0, v0 = rotl(v0, 32);
    v2 += v3, v3 = rotl(v3, 16), v3 ^= v2;
    v0 += v3, v3 = rotl(v3, 21), v3 ^= v0;
    v2 += v1, v1 = rotl(v1, 17), v1 ^= v2, v2 = rotl(v2, 32);
  };
  auto absorb = [&](uint64_t m) {
    v3 ^= m;
    round(), round();
    v0 ^= m;
  };
  const size_t whole = n & ~size_t{7};
  for (size_t i = 0; i < whole; i += 8) absorb(load_le64(in + i));
  uint64_t last = static_cast<uint64_t>(n & 0xFF) << 56;  // the length's low byte, then the tail
  for (size_t i = 0; i < (n & 7); ++i) last |= static_cast<uint64_t>(in[whole + i]) << (8 * i);
  absorb(last);
  v2 ^= 0xFF;
  round(), round(), round(), round();
  return v0 ^ v1 ^ v2 ^ v3;
}

// A keyed bijection of 64-bit values: a 4-round Feistel network over the two
// 32-bit halves whose round function is SipHash-2-4 of (tweak, round, half).
// A bijection keeps distinct inputs distinct; without the key its outputs
// look uniform, so a guess hits one given value with probability 2^-64.
inline uint64_t permute64(const uint8_t key[16], uint32_t tweak, uint64_t x) {
  uint32_t left = static_cast<uint32_t>(x >> 32), right = static_cast<uint32_t>(x);
  for (uint8_t r = 0; r < 4; ++r) {
    const uint8_t msg[9] = {uint8_t(tweak),      uint8_t(tweak >> 8), uint8_t(tweak >> 16),
                            uint8_t(tweak >> 24), r,                   uint8_t(right),
                            uint8_t(right >> 8),  uint8_t(right >> 16), uint8_t(right >> 24)};
    const uint32_t f = static_cast<uint32_t>(siphash24(key, msg, sizeof msg));
    const uint32_t next = left ^ f;
    left = right, right = next;
  }
  return (static_cast<uint64_t>(left) << 32) | right;
}

}  // namespace pz::keyed
