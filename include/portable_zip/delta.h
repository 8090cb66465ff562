// The weight-delta format, version 1 (docs/FORMAT.md, "Weight-delta
// streams"): version k+1 of a tensor coded exactly against version k. Every
// function here serves the CPU drivers (kernels/delta_cpu.cpp) and the GPU
// kernels (delta_gpu.h) alike, so both write and read the same bytes.
#pragma once
#include <stdint.h>

#include "format.h"

namespace pz::delta {

constexpr uint32_t kMagicWord = 'P' | 'Z' << 8 | 'D' << 16 | static_cast<uint32_t>('L') << 24;
constexpr uint8_t kVersion = 1;
constexpr int kHeaderBytes = 64;
constexpr int kEntryBytes = 8;  // block table entry: u32 payload bytes, u16 count, u8 k_gap, u8 k_value
constexpr int kBlockLog2 = 14;  // what the encoder writes
constexpr int kMinBlockLog2 = 10;
constexpr int kMaxBlockLog2 = 15;  // a block's count fits the entry's u16
constexpr uint32_t kEscapeOnes = 31;  // this many ones: the value follows raw
constexpr int kMaxK = 31;
// Header field offsets.
constexpr int kTotalOffset = 8;  // as in the codec's streams: a transport reads the size here
constexpr int kBodySumOffset = 56;
constexpr int kHeaderSumOffset = 60;

// Element width in bits of the dtypes a delta codes; 0 for the others.
PZ_HOST_DEVICE constexpr int width_bits(fmt::DType d) {
  return fmt::is_coded(d) ? 8 * fmt::elem_size(d) : 0;
}
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t low_mask(int bits) { return bits >= 32 ? ~0u : (1u << bits) - 1u; }

struct Header {
  uint8_t version = kVersion;
  fmt::DType dtype = fmt::DType::Invalid;
  uint8_t block_log2 = kBlockLog2;
  uint64_t total_bytes = 0, numel = 0, changed = 0, base_sum = 0, target_sum = 0, payload_bytes = 0;
  uint32_t body_sum = 0;
};

PZ_HOST_DEVICE inline uint64_t num_blocks(uint64_t numel, int log2) { return (numel + (1ull << log2) - 1) >> log2; }
PZ_HOST_DEVICE inline uint64_t payload_begin(uint64_t nblocks) { return kHeaderBytes + kEntryBytes * nblocks; }
PZ_HOST_DEVICE inline uint32_t block_elems(uint64_t numel, int log2, uint64_t b) {
  const uint64_t begin = b << log2, end = begin + (1ull << log2);
  return static_cast<uint32_t>((end < numel ? end : numel) - begin);
}

// --- element order ----------------------------------------------------------
// A float's bits mapped to an integer whose order is the float order (a
// bijection on all patterns, NaN and -0 included): neighbouring values differ
// by 1, so a step of a few ULPs is a small difference.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t to_order(uint32_t u, int w) {
  const uint32_t s = 1u << (w - 1);
  return (u & s) ? (~u & low_mask(w)) : (u | s);
}
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t from_order(uint32_t o, int w) {
  const uint32_t s = 1u << (w - 1);
  return (o & s) ? (o & ~s) : (~o & low_mask(w));
}
// zigzag(ord(t) - ord(b) mod 2^w): 0 iff unchanged, small for small steps.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t delta_zigzag(uint32_t b, uint32_t t, int w) {
  const uint32_t m = low_mask(w);
  const uint32_t d = (to_order(t, w) - to_order(b, w)) & m;
  return ((d << 1) & m) ^ ((d >> (w - 1)) & 1u ? m : 0u);
}
// The target from the base and a nonzero zigzag value.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t apply_zigzag(uint32_t b, uint32_t z, int w) {
  const uint32_t m = low_mask(w);
  const uint32_t d = (z >> 1) ^ (z & 1u ? m : 0u);
  return from_order((to_order(b, w) + d) & m, w);
}

// --- Rice codes ---------------------------------------------------------------
// x < 2^raw coded with parameter k (k <= raw, k <= 31): q = x >> k ones, a
// zero, then the k low bits; from q >= 31 on, 31 ones then x in raw bits.
// Bits go LSB-first into little-endian 32-bit words.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t rice_bits(uint32_t x, int k, int raw) {
  const uint32_t q = x >> k;
  return q < kEscapeOnes ? q + 1 + k : kEscapeOnes + raw;
}

// Deterministic parameter from integer sums alone: floor(log2(mean)).
PZ_HOST_DEVICE inline int choose_k(uint64_t sum, uint64_t count, int raw) {
  if (count == 0) return 0;
  uint64_t mean = sum / count;
  int k = 0;
  while (mean > 1) mean >>= 1, ++k;
  const int cap = raw < kMaxK ? raw : kMaxK;
  return k < cap ? k : cap;
}

// Writes the low n (<= 32) bits of v at bit `bit`: or_word(word index, bits)
// ORs into zeroed words (plain on the CPU, atomic on the GPU).
template <class Or>
PZ_HOST_DEVICE PZ_FORCE_INLINE void put_bits(Or& or_word, uint64_t bit, uint32_t v, int n) {
  if (n == 0) return;
  const uint64_t w = bit >> 5;
  const int s = static_cast<int>(bit & 31);
  or_word(w, v << s);
  if (s + n > 32) or_word(w + 1, v >> (32 - s));
}

template <class Or>
PZ_HOST_DEVICE PZ_FORCE_INLINE uint64_t put_rice(Or& or_word, uint64_t bit, uint32_t x, int k, int raw) {
  const uint32_t q = x >> k;
  if (q < kEscapeOnes) {
    put_bits(or_word, bit, (1u << q) - 1u, static_cast<int>(q) + 1);
    bit += q + 1;
    put_bits(or_word, bit, x & low_mask(k), k);
    return bit + k;
  }
  put_bits(or_word, bit, low_mask(kEscapeOnes), kEscapeOnes);
  put_bits(or_word, bit + kEscapeOnes, x, raw);
  return bit + kEscapeOnes + raw;
}

// Reads a block's words; bits past its end read as zero (the caller checks
// how many were consumed), so no read leaves the block. A 64-bit buffer holds
// the next 33-64 bits, refilled a word at a time: one load per 32 bits read,
// not two per peek (on the GPU each load is a round trip on the decode chain).
struct BitReader {
  const uint8_t* p;
  uint64_t nwords;
  uint64_t pos = 0;   // bits consumed
  uint64_t buf = 0;   // bits [pos, pos + have) of the block, the next one lowest
  int have = 0;
  uint64_t next = 0;  // the word that refills buf next
  PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t word(uint64_t w) const { return w < nwords ? fmt::get_u32(p + 4 * w) : 0u; }
  PZ_HOST_DEVICE PZ_FORCE_INLINE void fill() {
    while (have <= 32) buf |= static_cast<uint64_t>(word(next++)) << have, have += 32;
  }
  PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t peek() {
    fill();
    return static_cast<uint32_t>(buf);
  }
  PZ_HOST_DEVICE PZ_FORCE_INLINE void skip(int n) {  // n <= 32
    fill();
    buf >>= n, have -= n, pos += n;
  }
  PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t take(int n) {  // n <= 32
    const uint32_t v = n ? peek() & low_mask(n) : 0u;
    skip(n);
    return v;
  }
};

PZ_HOST_DEVICE PZ_FORCE_INLINE int trailing_ones(uint32_t v) {
  const uint32_t z = ~v;
  if (!z) return 32;
#if defined(PZ_DEVICE_COMPILE)
  return ffs32(z) - 1;
#else
  return __builtin_ctz(z);  // one instruction (popcount is a libgcc call without -mpopcnt)
#endif
}

// One Rice code; false when the value exceeds limit (corrupted bits).
PZ_HOST_DEVICE PZ_FORCE_INLINE bool get_rice(BitReader& r, int k, int raw, uint32_t limit, uint32_t* x) {
  const int q = trailing_ones(r.peek());
  uint64_t v;
  if (q >= static_cast<int>(kEscapeOnes)) {
    r.skip(kEscapeOnes);
    v = r.take(raw);
  } else {
    r.skip(q + 1);
    v = (static_cast<uint64_t>(q) << k) | r.take(k);
  }
  *x = static_cast<uint32_t>(v);
  return v <= limit;
}

// --- block table ----------------------------------------------------------------
struct Entry {
  uint32_t bytes;  // the block's payload, a whole number of 32-bit words
  uint32_t count;  // changed elements
  int k_gap, k_value;
};
PZ_HOST_DEVICE inline Entry get_entry(const uint8_t* p) {
  return {fmt::get_u32(p), static_cast<uint32_t>(p[4] | p[5] << 8), p[6], p[7]};
}
PZ_HOST_DEVICE inline void put_entry(uint8_t* p, const Entry& e) {
  fmt::put_u32(p, e.bytes);
  p[4] = static_cast<uint8_t>(e.count), p[5] = static_cast<uint8_t>(e.count >> 8);
  p[6] = static_cast<uint8_t>(e.k_gap), p[7] = static_cast<uint8_t>(e.k_value);
}

// Bits of one changed element's codes: the gap since the previous changed
// element (block_log2 raw bits) and zigzag - 1 (w raw bits).
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t element_bits(uint32_t gap, uint32_t z, const Entry& e, int log2, int w) {
  return rice_bits(gap, e.k_gap, log2) + rice_bits(z - 1, e.k_value, w);
}
// The most a block of n elements can take: every code escaped.
PZ_HOST_DEVICE inline uint64_t max_block_bytes(uint32_t n, int log2, int w) {
  return 4 * ((static_cast<uint64_t>(n) * (2 * kEscapeOnes + log2 + w) + 31) / 32);
}
PZ_HOST_DEVICE inline uint64_t max_stream_bytes(fmt::DType d, uint64_t numel, int log2 = kBlockLog2) {
  const uint64_t nb = num_blocks(numel, log2);
  uint64_t total = payload_begin(nb);
  if (nb) total += (nb - 1) * max_block_bytes(1u << log2, log2, width_bits(d));
  if (nb) total += max_block_bytes(block_elems(numel, log2, nb - 1), log2, width_bits(d));
  return total;
}
// An entry the decoder may follow: its counts and parameters in range.
PZ_HOST_DEVICE inline bool entry_ok(const Entry& e, uint32_t n, int log2, int w) {
  return e.bytes % 4 == 0 && e.count <= n && e.bytes <= max_block_bytes(n, log2, w) && e.k_gap <= log2 &&
         e.k_value <= (w < kMaxK ? w : kMaxK) && (e.count > 0 || (e.bytes == 0 && e.k_gap == 0 && e.k_value == 0));
}

// Decodes block `words` (e.bytes bytes, validated by entry_ok) of n
// elements, calling apply(position in block, zigzag) per changed element in
// order. False when the bits do not decode to exactly e.count changes filling
// exactly e.bytes; apply has then seen only in-range positions. The same
// function decodes on the CPU (a thread per block) and the GPU.
template <class Apply>
PZ_HOST_DEVICE inline bool decode_block(const uint8_t* words, const Entry& e, uint32_t n, int log2, int w,
                                        Apply&& apply) {
  BitReader r{words, e.bytes / 4u};
  const uint64_t nbits = 8ull * e.bytes;
  uint32_t next = 0;  // the lowest position the next change may take
  for (uint32_t i = 0; i < e.count; ++i) {
    uint32_t gap, v;
    if (next >= n || !get_rice(r, e.k_gap, log2, n - 1 - next, &gap) ||
        !get_rice(r, e.k_value, w, low_mask(w) - 1u, &v) || r.pos > nbits)
      return false;
    apply(next + gap, v + 1u);
    next += gap + 1;
  }
  return (r.pos + 31) / 32 == e.bytes / 4u;
}

// Loads and stores of one element as a w-bit integer.
template <class T>
PZ_HOST_DEVICE PZ_FORCE_INLINE void apply_element(T* base, uint32_t pos, uint32_t z, int w) {
  base[pos] = static_cast<T>(apply_zigzag(base[pos], z, w));
}

// --- checksums ----------------------------------------------------------------
// A tensor's 64-bit checksum: two sums of fmt::hash_term over its 32-bit
// little-endian units (the last zero-padded), with different unit and index
// mixes, so threads and GPU blocks add their shares in any order.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t unit_index(uint64_t i) {
  return static_cast<uint32_t>(i) ^ (static_cast<uint32_t>(i >> 32) * 0x27D4EB2Fu);
}
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t term_lo(uint32_t unit, uint32_t ix) { return fmt::hash_term(unit, ix); }
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t term_hi(uint32_t unit, uint32_t ix) {
  return fmt::hash_term(((unit << 16) | (unit >> 16)) ^ 0x2545F491u, ix ^ 0x68E31DA4u);
}
// Unit i of nbytes bytes at p, zero-padded past the end.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t tail_unit(const uint8_t* p, uint64_t nbytes, uint64_t i) {
  uint32_t u = 0;
  for (uint64_t j = 4 * i; j < 4 * i + 4 && j < nbytes; ++j) u |= static_cast<uint32_t>(p[j]) << (8 * (j - 4 * i));
  return u;
}
constexpr uint32_t kSeedLo = 0x4C445A50u, kSeedHi = 0x31544C44u;
// The checksum from the two sums; the byte count is mixed in so sizes differ.
PZ_HOST_DEVICE inline uint64_t finish_checksum(uint32_t lo, uint32_t hi, uint64_t nbytes) {
  lo += kSeedLo + fmt::hash_term(static_cast<uint32_t>(nbytes), 0xFFFFFFFFu);
  hi += kSeedHi + fmt::hash_term(static_cast<uint32_t>(nbytes >> 32), 0xFFFFFFFEu);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
// The stream's body checksum (table and payload): the low half.
PZ_HOST_DEVICE inline uint32_t body_checksum(uint64_t checksum) { return static_cast<uint32_t>(checksum); }

// Header checksum: fmt::hash_term over words 0..14 (all but itself).
PZ_HOST_DEVICE inline uint32_t header_checksum(const uint8_t* p) {
  uint32_t s = 0;
  for (uint32_t k = 0; k < kHeaderSumOffset / 4; ++k) s += fmt::hash_term(fmt::get_u32(p + 4 * k), k);
  return fmt::finish_checksum(s);
}

PZ_HOST_DEVICE inline void write_header(const Header& h, uint8_t* p) {
  for (int i = 0; i < kHeaderBytes; ++i) p[i] = 0;
  fmt::put_u32(p, kMagicWord);
  p[4] = h.version;
  p[5] = static_cast<uint8_t>(h.dtype);
  p[6] = h.block_log2;
  fmt::put_u64(p + kTotalOffset, h.total_bytes);
  fmt::put_u64(p + 16, h.numel);
  fmt::put_u64(p + 24, h.changed);
  fmt::put_u64(p + 32, h.base_sum);
  fmt::put_u64(p + 40, h.target_sum);
  fmt::put_u64(p + 48, h.payload_bytes);
  fmt::put_u32(p + kBodySumOffset, h.body_sum);
  fmt::put_u32(p + kHeaderSumOffset, header_checksum(p));
}

enum class Error : uint32_t {
  Ok = 0,
  TooShort,
  BadMagic,
  BadVersion,
  BadDType,
  BadParams,
  BadTotal,
  BadHeaderChecksum,
  Truncated,
  BadBodyChecksum,
  BadTable,
  BadBlock,
  Mismatch,        // another dtype or element count than the base
  BaseMismatch,    // the base's checksum is not the stream's base
  TargetMismatch,  // the rebuilt tensor's checksum is not the stream's target
};

inline const char* error_text(Error e) {
  switch (e) {
    case Error::Ok: return "ok";
    case Error::TooShort: return "delta stream is shorter than its 64-byte header";
    case Error::BadMagic: return "bad magic: not a portable_zip delta stream";
    case Error::BadVersion: return "unsupported delta format version (this build reads version 1)";
    case Error::BadDType: return "delta header names a dtype deltas do not code";
    case Error::BadParams: return "delta header fields are out of range (block size, changed count, reserved bytes)";
    case Error::BadTotal: return "delta header sizes are inconsistent (total, payload and block count)";
    case Error::BadHeaderChecksum: return "delta header checksum mismatch: the header is corrupted (or was edited)";
    case Error::Truncated: return "delta stream is truncated: shorter than the total size in its header";
    case Error::BadBodyChecksum: return "delta stream checksum mismatch: its block table or payload is corrupted";
    case Error::BadTable: return "delta block table is inconsistent (counts, sizes or parameters out of range)";
    case Error::BadBlock: return "a delta block's coded bits are inconsistent (corrupted payload)";
    case Error::Mismatch: return "the delta stream holds another dtype or element count than the base tensor";
    case Error::BaseMismatch: return "the base tensor is not the version the delta was made against (checksum differs)";
    case Error::TargetMismatch:
      return "the rebuilt tensor does not match the delta's target checksum: it no longer holds a known version "
             "(needs a full sync)";
  }
  return "unknown error";
}

// Validates the header of a stream of stream_len bytes (the first
// min(head_len, stream_len) at p). After Ok, [0, total_bytes) holds the
// header, the table of num_blocks entries and payload_bytes, within stream_len.
PZ_HOST_DEVICE inline Error parse_header(const uint8_t* p, uint64_t head_len, uint64_t stream_len, Header* h) {
  if ((head_len < stream_len ? head_len : stream_len) < static_cast<uint64_t>(kHeaderBytes)) return Error::TooShort;
  if (fmt::get_u32(p) != kMagicWord) return Error::BadMagic;
  h->version = p[4];
  if (h->version != kVersion) return Error::BadVersion;
  h->dtype = static_cast<fmt::DType>(p[5]);
  if (p[5] >= static_cast<uint8_t>(fmt::DType::Count) || width_bits(h->dtype) == 0) return Error::BadDType;
  h->block_log2 = p[6];
  h->total_bytes = fmt::get_u64(p + kTotalOffset);
  h->numel = fmt::get_u64(p + 16);
  h->changed = fmt::get_u64(p + 24);
  h->base_sum = fmt::get_u64(p + 32);
  h->target_sum = fmt::get_u64(p + 40);
  h->payload_bytes = fmt::get_u64(p + 48);
  h->body_sum = fmt::get_u32(p + kBodySumOffset);
  if (h->block_log2 < kMinBlockLog2 || h->block_log2 > kMaxBlockLog2 || p[7] != 0 || h->numel > fmt::kMaxNumel ||
      h->changed > h->numel)
    return Error::BadParams;
  const uint64_t begin = payload_begin(num_blocks(h->numel, h->block_log2));
  if (h->payload_bytes > max_stream_bytes(h->dtype, h->numel, h->block_log2) - begin ||
      h->total_bytes != begin + h->payload_bytes || h->payload_bytes % 4)
    return Error::BadTotal;
  if (fmt::get_u32(p + kHeaderSumOffset) != header_checksum(p)) return Error::BadHeaderChecksum;
  if (h->total_bytes > stream_len) return Error::Truncated;
  return Error::Ok;
}

// A GPU apply's verdict before any write, from the kernels' results (the
// body checksum, the table and dry-decode error bits kTableBit/kBlockBit, the
// base checksum), in the CPU's order of checks.
inline Error check_verdict(const Header& h, uint32_t body_sum, uint32_t err, uint32_t table_bit, uint32_t block_bit,
                           uint64_t base_sum) {
  if (body_sum != h.body_sum) return Error::BadBodyChecksum;
  if (err & table_bit) return Error::BadTable;
  if (err & block_bit) return Error::BadBlock;
  if (base_sum != h.base_sum) return Error::BaseMismatch;
  return Error::Ok;
}

}  // namespace pz::delta
