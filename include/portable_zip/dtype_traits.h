// Per-dtype split of a value into an 8-bit symbol (entropy-coded) and raw
// bits (stored as they are), and the exact inverse. Symbol i covers element i,
// or elements 2i and 2i+1 for fp8. unit() is the symbol's element bytes as one
// little-endian integer: what the v2 block checksum hashes.
#pragma once
#include <stdint.h>

#include "format.h"

namespace pz {

struct Split {
  uint8_t sym;
  uint8_t raw8;
  uint16_t raw16;  // fp32 only
};

template <fmt::DType D>
struct FloatTraits;

// bf16: symbol = 8 exponent bits; raw = sign | 7 mantissa bits.
template <>
struct FloatTraits<fmt::DType::BFloat16> {
  static constexpr int kElemBytes = 2;
  PZ_HOST_DEVICE static PZ_FORCE_INLINE Split split(const uint8_t* in, uint64_t i, uint64_t) {
    const uint32_t w = in[2 * i] | (uint32_t(in[2 * i + 1]) << 8);
    return {uint8_t(w >> 7), uint8_t(((w >> 8) & 0x80) | (w & 0x7f)), 0};
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE void join(uint8_t* out, uint64_t i, uint64_t, uint8_t sym, uint8_t raw8, uint16_t) {
    const uint32_t w = (uint32_t(raw8 & 0x80) << 8) | (uint32_t(sym) << 7) | (raw8 & 0x7f);
    out[2 * i] = uint8_t(w);
    out[2 * i + 1] = uint8_t(w >> 8);
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint32_t unit(const uint8_t* p, uint64_t i, uint64_t) {
    return p[2 * i] | (uint32_t(p[2 * i + 1]) << 8);
  }
};

// fp16: symbol = top byte (sign, 5 exponent bits, 2 mantissa bits); raw = low byte.
template <>
struct FloatTraits<fmt::DType::Float16> {
  static constexpr int kElemBytes = 2;
  PZ_HOST_DEVICE static PZ_FORCE_INLINE Split split(const uint8_t* in, uint64_t i, uint64_t) {
    return {in[2 * i + 1], in[2 * i], 0};
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE void join(uint8_t* out, uint64_t i, uint64_t, uint8_t sym, uint8_t raw8, uint16_t) {
    out[2 * i] = raw8;
    out[2 * i + 1] = sym;
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint32_t unit(const uint8_t* p, uint64_t i, uint64_t) {
    return p[2 * i] | (uint32_t(p[2 * i + 1]) << 8);
  }
};

// fp32: symbol = 8 exponent bits; raw = sign | mantissa bits 22..16 (plane8)
// and mantissa bits 15..0 (plane16).
template <>
struct FloatTraits<fmt::DType::Float32> {
  static constexpr int kElemBytes = 4;
  PZ_HOST_DEVICE static PZ_FORCE_INLINE Split split(const uint8_t* in, uint64_t i, uint64_t) {
    const uint8_t* p = in + 4 * i;
    const uint32_t w = p[0] | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
    return {uint8_t(w >> 23), uint8_t(((w >> 24) & 0x80) | ((w >> 16) & 0x7f)), uint16_t(w)};
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE void join(uint8_t* out, uint64_t i, uint64_t, uint8_t sym, uint8_t raw8, uint16_t raw16) {
    const uint32_t w = (uint32_t(raw8 & 0x80) << 24) | (uint32_t(sym) << 23) | (uint32_t(raw8 & 0x7f) << 16) | raw16;
    uint8_t* p = out + 4 * i;
    p[0] = uint8_t(w);
    p[1] = uint8_t(w >> 8);
    p[2] = uint8_t(w >> 16);
    p[3] = uint8_t(w >> 24);
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint32_t unit(const uint8_t* p, uint64_t i, uint64_t) {
    p += 4 * i;
    return p[0] | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
  }
};

// fp8 pairs. For both e4m3fn and e5m2 a value's code is bits 6..3 and its raw
// nibble is sign | bits 2..0. For e4m3fn the code is the whole exponent; for
// e5m2 it is the top four exponent bits, with the lowest exponent bit going
// raw (docs/FORMAT.md gives the measured ratios behind this choice).
// Symbol = code(x0) | code(x1) << 4; raw = nib(x0) | nib(x1) << 4. An odd
// last element pairs with a zero that the decoder never writes.
struct Fp8PairTraits {
  static constexpr int kElemBytes = 1;
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint8_t code(uint8_t x) { return (x >> 3) & 0xf; }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint8_t nib(uint8_t x) { return ((x >> 4) & 0x8) | (x & 0x7); }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint8_t unsplit(uint8_t code4, uint8_t nib4) {
    return uint8_t(((nib4 & 0x8) << 4) | (code4 << 3) | (nib4 & 0x7));
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE Split split(const uint8_t* in, uint64_t i, uint64_t numel) {
    const uint8_t x0 = in[2 * i];
    const uint8_t x1 = 2 * i + 1 < numel ? in[2 * i + 1] : 0;
    return {uint8_t(code(x0) | (code(x1) << 4)), uint8_t(nib(x0) | (nib(x1) << 4)), 0};
  }
  PZ_HOST_DEVICE static PZ_FORCE_INLINE void join(uint8_t* out, uint64_t i, uint64_t numel, uint8_t sym, uint8_t raw8, uint16_t) {
    out[2 * i] = unsplit(sym & 0xf, raw8 & 0xf);
    if (2 * i + 1 < numel) out[2 * i + 1] = unsplit(sym >> 4, raw8 >> 4);
  }
  // The pair's element bytes; an odd last element pairs with zero.
  PZ_HOST_DEVICE static PZ_FORCE_INLINE uint32_t unit(const uint8_t* p, uint64_t i, uint64_t numel) {
    return p[2 * i] | (2 * i + 1 < numel ? uint32_t(p[2 * i + 1]) << 8 : 0u);
  }
};

template <>
struct FloatTraits<fmt::DType::Float8E4M3FN> : Fp8PairTraits {};
template <>
struct FloatTraits<fmt::DType::Float8E5M2> : Fp8PairTraits {};

}  // namespace pz

// Runtime dtype -> template argument, in one place (flashinfer-style).
#define PZ_DISPATCH_CODED_DTYPE(dtype, D, ...)                                          \
  [&]() -> int {                                                                         \
    switch (dtype) {                                                                     \
      case ::pz::fmt::DType::BFloat16: { constexpr auto D = ::pz::fmt::DType::BFloat16; return __VA_ARGS__(); } \
      case ::pz::fmt::DType::Float16: { constexpr auto D = ::pz::fmt::DType::Float16; return __VA_ARGS__(); }   \
      case ::pz::fmt::DType::Float32: { constexpr auto D = ::pz::fmt::DType::Float32; return __VA_ARGS__(); }   \
      case ::pz::fmt::DType::Float8E4M3FN: { constexpr auto D = ::pz::fmt::DType::Float8E4M3FN; return __VA_ARGS__(); } \
      case ::pz::fmt::DType::Float8E5M2: { constexpr auto D = ::pz::fmt::DType::Float8E5M2; return __VA_ARGS__(); }     \
      default: return -1;                                                                \
    }                                                                                    \
  }()
