// Per-block pieces shared by the GPU kernels and the CPU driver: segment
// layout constants, decode error bits, and the look-back status encoding.
#pragma once
#include <stdint.h>

#include "dtype_traits.h"
#include "rans.h"

namespace pz {

// Decode error bits, OR-ed into one word; kernels/ maps them to messages.
enum DecodeError : uint32_t {
  kErrOffsets = 1u << 0,  // block offset table out of order or out of bounds
  kErrTable = 1u << 1,    // malformed frequency table
  kErrSegment = 1u << 2,  // segment too short for its mode / unknown mode
  kErrStream = 1u << 3,   // rANS states or words inconsistent (corrupted data)
  kErrChecksum = 1u << 4, // decoded bytes differ from the block's (or raw chunk's) checksum
  kErrBool = 1u << 5,     // a bool stream holds a byte other than 0 or 1
  // Decodes that parse the header on the device (no host sync):
  kErrHeader = 1u << 6,   // the header is invalid; bits 8..15 hold its fmt::ParseError
  kErrMismatch = 1u << 7, // the stream holds another dtype or shape than the output
};
constexpr uint32_t kKnownDecodeErrors =
    kErrOffsets | kErrTable | kErrSegment | kErrStream | kErrChecksum | kErrBool | kErrHeader | kErrMismatch;
constexpr int kParseErrorShift = 8;

// Where block b's segment lies, from the offset table; returns false (and
// leaves *begin/*end unspecified) when the table is inconsistent.
PZ_HOST_DEVICE inline bool segment_bounds(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l,
                                          uint64_t b, uint64_t* begin, uint64_t* end) {
  const uint8_t* offs = stream + l.offsets_begin;
  const uint64_t coded_len = l.total - l.coded_begin;
  *begin = b == 0 ? 0 : fmt::get_u64(offs + 8 * (b - 1));
  *end = fmt::get_u64(offs + 8 * b);
  const uint64_t n = fmt::block_symbols(h, l, b);
  if (*begin > *end || *end > coded_len || *begin % fmt::kAlign != 0) return false;
  if (*end - *begin > fmt::max_segment_bytes(n) || *end - *begin < fmt::kAlign) return false;
  if (b + 1 == l.nblocks && *end != coded_len) return false;
  return true;
}

// v3: how many of `lanes` lanes hold a symbol in column j of a row of `left`
// symbols (all in a full row; fewer, or none, in a short last row).
PZ_HOST_DEVICE PZ_FORCE_INLINE int row_lanes(uint32_t left, int j, int lanes) {
  const uint32_t k = (left + fmt::kLaneRun - 1 - j) / fmt::kLaneRun;
  return static_cast<int>(k < static_cast<uint32_t>(lanes) ? k : static_cast<uint32_t>(lanes));
}

// The v3 block checksum's 32-bit words [*lo, *hi) of the tensor's bytes, and
// the tensor's byte length *len (past which a word is zero-padded).
PZ_HOST_DEVICE PZ_FORCE_INLINE void block_words(const fmt::Header& h, uint64_t first, uint32_t n, uint64_t* lo,
                                                uint64_t* hi, uint64_t* len) {
  const uint64_t s = fmt::symbol_bytes(h.dtype);
  *len = h.numel * static_cast<uint64_t>(fmt::elem_size(h.dtype));
  const uint64_t end = (first + n) * s;
  *lo = first * s / 4;
  *hi = ((end < *len ? end : *len) + 3) / 4;
}

// Reads the raw bits of symbol i from the raw planes.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint16_t raw16_at(const uint8_t* stream, const fmt::Layout& l, bool plane16, uint64_t i) {
  if (!plane16) return 0;
  const uint8_t* p = stream + l.plane16_begin + 2 * i;
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

PZ_HOST_DEVICE PZ_FORCE_INLINE void write_raw(uint8_t* stream, const fmt::Layout& l, bool plane16, uint64_t i, const Split& sp) {
  stream[l.raw_begin + i] = sp.raw8;
  if (plane16) {
    uint8_t* p = stream + l.plane16_begin + 2 * i;
    p[0] = static_cast<uint8_t>(sp.raw16);
    p[1] = static_cast<uint8_t>(sp.raw16 >> 8);
  }
}

using fmt::get_u32;
using fmt::put_u32;

// Checksum of a raw payload's 32-bit word k (bytes 4k..4k+3 of the payload,
// zero past its end `len`), read from p = the payload's start.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t raw_word(const uint8_t* p, uint64_t k, uint64_t len) {
  if (4 * k + 4 <= len) return get_u32(p + 4 * k);
  uint32_t w = 0;
  for (uint64_t i = 4 * k; i < len; ++i) w |= uint32_t(p[i]) << (8 * (i - 4 * k));
  return w;
}

// Freq in the low 16 bits, cumulative freq in the high 16.
PZ_HOST_DEVICE inline void build_encsym(const uint16_t* freq, uint32_t* encsym) {
  uint32_t cum = 0;
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    encsym[s] = freq[s] | (cum << 16);
    cum += freq[s];
  }
}

// The fixed code's table: the 7 most frequent symbols, by count descending
// then symbol ascending (absent symbols fill in, lowest first), so every
// backend picks the same table.
PZ_HOST_DEVICE inline void fixed_table(const uint32_t* counts, uint8_t* table) {
  uint32_t taken[8] = {};
  for (int c = 0; c < fmt::kFixedCodes; ++c) {
    int best = -1;
    for (int s = 0; s < fmt::kNumSymbols; ++s)
      if (!(taken[s >> 5] >> (s & 31) & 1) && (best < 0 || counts[s] > counts[best])) best = s;
    taken[best >> 5] |= 1u << (best & 31);
    table[c] = static_cast<uint8_t>(best);
  }
}

// Bytes a fixed segment needs before padding.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint64_t fixed_segment_bytes(uint32_t n, uint64_t escapes) {
  return fmt::kFixedPrefixBytes + fmt::fixed_planes_bytes(n) + escapes;
}

// Look-back status words: 2 flag bits + 62-bit byte count.
constexpr uint64_t kStatusAggregate = 1ull << 62;
constexpr uint64_t kStatusPrefix = 2ull << 62;
constexpr uint64_t kStatusValue = (1ull << 62) - 1;

}  // namespace pz
