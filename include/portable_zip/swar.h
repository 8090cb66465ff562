// FloatTraits::split and join for one 8-symbol chunk, a 32-bit word at a
// time: a symbol and a raw byte sit at fixed bit positions of each element,
// so shifts and byte permutes gather four at a time (bf16: 2 instructions per
// symbol instead of ~15 for the byte-wise split). Host and device code, so
// that tests/test_swar.py can check them against FloatTraits on the CPU.
#pragma once
#include <stdint.h>

#include "format.h"

namespace pz {

// in_words: the chunk's 16 bytes (fp32: 32) as little-endian words. Symbol
// k (and raw byte k) is byte k & 3 of sym[k >> 2] (raw8[k >> 2]); fp32's
// raw16 half k is half k & 1 of raw16[k >> 1]. Other dtypes leave raw16 alone.
template <fmt::DType D>
PZ_HOST_DEVICE PZ_FORCE_INLINE void split_words(const uint32_t* in_words, uint32_t sym[2], uint32_t raw8[2],
                                                uint32_t raw16[4]) {
  const uint32_t* v = in_words;
  if constexpr (D == fmt::DType::BFloat16) {
    // Per 16-bit element: symbol = bits 7..14, raw byte = bit 15 over bits
    // 0..6. sign_low puts the raw byte in the low byte of each half (the
    // high bytes are dropped by the permute).
    auto sign_low = [](uint32_t w) { return (w & 0x007f007fu) | ((w >> 8) & ~0x007f007fu); };
    sym[0] = byte_perm(v[0] >> 7, v[1] >> 7, 0x6420);
    sym[1] = byte_perm(v[2] >> 7, v[3] >> 7, 0x6420);
    raw8[0] = byte_perm(sign_low(v[0]), sign_low(v[1]), 0x6420);
    raw8[1] = byte_perm(sign_low(v[2]), sign_low(v[3]), 0x6420);
  } else if constexpr (D == fmt::DType::Float16) {
    // symbol = high byte, raw = low byte
    sym[0] = byte_perm(v[0], v[1], 0x7531);
    sym[1] = byte_perm(v[2], v[3], 0x7531);
    raw8[0] = byte_perm(v[0], v[1], 0x6420);
    raw8[1] = byte_perm(v[2], v[3], 0x6420);
  } else if constexpr (D == fmt::DType::Float32) {
    // Per word: symbol = bits 23..30 (byte 3 of w << 1), raw byte = bit 31
    // over bits 16..22 (byte 2 of sign_mid), raw16 = the low half.
    auto sign_mid = [](uint32_t x) { return (x & 0x007f0000u) | ((x >> 8) & ~0x007f0000u); };
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t* x = v + 4 * q;
      sym[q] = byte_perm(byte_perm(x[0] << 1, x[1] << 1, 0x0073), byte_perm(x[2] << 1, x[3] << 1, 0x0073), 0x5410);
      raw8[q] = byte_perm(byte_perm(sign_mid(x[0]), sign_mid(x[1]), 0x0062), byte_perm(sign_mid(x[2]), sign_mid(x[3]), 0x0062),
                          0x5410);
      raw16[2 * q] = byte_perm(x[0], x[1], 0x5410);
      raw16[2 * q + 1] = byte_perm(x[2], x[3], 0x5410);
    }
  } else {
    static_assert(D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2, "fp8 pairs");
    // A symbol is a pair of elements: per byte, code = bits 3..6 and nibble
    // = bit 7 over bits 0..2 (Fp8PairTraits); x | x >> 4 joins the pair in
    // the low byte of each 16-bit half.
    auto codes = [](uint32_t x) {
      const uint32_t c = (x >> 3) & 0x0f0f0f0fu;
      return c | c >> 4;
    };
    auto nibs = [](uint32_t x) {
      const uint32_t n = ((x >> 4) & 0x08080808u) | (x & 0x07070707u);
      return n | n >> 4;
    };
    sym[0] = byte_perm(codes(v[0]), codes(v[1]), 0x6420);
    sym[1] = byte_perm(codes(v[2]), codes(v[3]), 0x6420);
    raw8[0] = byte_perm(nibs(v[0]), nibs(v[1]), 0x6420);
    raw8[1] = byte_perm(nibs(v[2]), nibs(v[3]), 0x6420);
  }
}

// The inverse of split_words, same bit positions: the chunk's words w[4]
// (fp32: w[8]) from its 8 symbols sym[k] (one a word, below 256), raw bytes
// r8x (0..3) and r8y (4..7) and fp32's raw16 words. bf16: raw byte r = sign
// << 7 | m, so the element is r + (r & 0x80) * 255 + (sym << 7), two elements
// a word with no carry between them; fp32: the raw bytes permuted over raw16,
// the sign kept and the symbol ORed in.
template <fmt::DType D>
PZ_HOST_DEVICE PZ_FORCE_INLINE void join_words(const uint32_t* sym, uint32_t r8x, uint32_t r8y, const uint32_t* r16,
                                               uint32_t* w) {
  if constexpr (D == fmt::DType::BFloat16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t t = byte_perm(j < 2 ? r8x : r8y, 0u, (j & 1) ? 0x4342 : 0x4140);  // raw bytes 2j, 2j+1 -> halves
      w[j] = t + (t & 0x00800080u) * 255u + (sym[2 * j] | sym[2 * j + 1] << 16) * 128u;
    }
  } else if constexpr (D == fmt::DType::Float16) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = byte_perm(j < 2 ? r8x : r8y, sym[2 * j] | sym[2 * j + 1] << 8, (j & 1) ? 0x5342 : 0x5140);
  } else if constexpr (D == fmt::DType::Float32) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      // bytes: raw16 (half k & 1 of its word), then the raw byte twice
      const uint32_t lo = 2 * (k & 1), rb = 4 + (k & 3);
      const uint32_t t = byte_perm(r16[k >> 1], k < 4 ? r8x : r8y, lo | (lo + 1) << 4 | rb << 8 | rb << 12);
      w[k] = (t & 0x807fffffu) | sym[k] << 23;
    }
  } else {
    static_assert(D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2, "fp8 pairs");
    // Each symbol's two codes and each raw byte's two nibbles spread to the
    // bytes of their elements, then every byte is nibble bit 3 << 4 | code
    // << 3 | nibble bits 0..2 (Fp8PairTraits::unsplit), four at a time.
    auto spread = [](uint32_t v) { return (v & 0x000f000fu) | (v & 0x00f000f0u) << 4; };
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t cb = spread(sym[2 * j] | sym[2 * j + 1] << 16);
      const uint32_t nb = spread(byte_perm(j < 2 ? r8x : r8y, 0u, (j & 1) ? 0x4342 : 0x4140));
      w[j] = (nb & 0x08080808u) << 4 | cb << 3 | (nb & 0x07070707u);
    }
  }
}

}  // namespace pz
