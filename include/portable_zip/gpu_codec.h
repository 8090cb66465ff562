// GPU compress and decompress kernels. One 32-lane group owns one block; a
// CTA holds kGroupsPerCta groups (one wave64 on CDNA, two warps elsewhere).
//
// Compress is one fused launch: split + histogram + table + encode, then a
// decoupled look-back over the blocks' sizes gives each block its final
// offset, and the block writes its segment straight there. No host sync, no
// global histogram, no coalescing pass.
#pragma once
#include <stdint.h>

#include "block.h"
#include "gpu_params.h"

namespace pz::gpu {

// Bytes of input per symbol, and symbols per 16-byte-aligned vector chunk.
template <fmt::DType D>
constexpr int kSymBytes = D == fmt::DType::Float32 ? 4 : 2;
constexpr int kChunkSyms = 8;

#if defined(PZ_CUDA) || defined(PZ_HIP)

PZ_DEVICE PZ_FORCE_INLINE uint32_t group_sum32(uint32_t v) {
#pragma unroll
  for (int m = 1; m < fmt::kLanes; m <<= 1) v += group_shfl_xor(v, m);
  return v;
}

// Exclusive prefix sum over lanes.
PZ_DEVICE PZ_FORCE_INLINE uint32_t group_exclusive_scan(uint32_t v) {
  const int lane = group_lane();
  uint32_t inc = v;
#pragma unroll
  for (int d = 1; d < fmt::kLanes; d <<= 1) {
    const uint32_t o = group_shfl(inc, lane >= d ? lane - d : lane);
    if (lane >= d) inc += o;
  }
  return inc - v;
}

// (value, index) argmax over lanes; ties go to the lower index.
PZ_DEVICE PZ_FORCE_INLINE void group_argmax(uint32_t* value, uint32_t* index) {
#pragma unroll
  for (int m = 1; m < fmt::kLanes; m <<= 1) {
    const uint32_t ov = group_shfl_xor(*value, m), oi = group_shfl_xor(*index, m);
    if (ov > *value || (ov == *value && oi < *index)) *value = ov, *index = oi;
  }
}

// rans::quantize computed by the whole group; identical results. Lane L owns
// symbols 8L..8L+7.
PZ_DEVICE inline void quantize_group(const uint32_t* counts, uint32_t n, uint16_t* freq) {
  const int lane = group_lane();
  uint32_t sum = 0, best_c = 0, best_s = 256;
  for (int k = 0; k < 8; ++k) {
    const uint32_t s = 8 * lane + k, c = counts[s];
    uint32_t f = 0;
    if (c) {
      f = static_cast<uint32_t>((static_cast<uint64_t>(c) * fmt::kProbScale + n / 2) / n);
      if (f == 0) f = 1;
      if (c > best_c) best_c = c, best_s = s;
    }
    freq[s] = static_cast<uint16_t>(f);
    sum += f;
  }
  sum = group_sum32(sum);
  group_argmax(&best_c, &best_s);
  int32_t d = static_cast<int32_t>(fmt::kProbScale) - static_cast<int32_t>(sum);
  group_sync();
  if (d > 0 && lane == 0) freq[best_s] = static_cast<uint16_t>(freq[best_s] + d);
  while (d < 0) {  // group-uniform
    uint32_t top_f = 0, top_s = 256;
    for (int k = 0; k < 8; ++k) {
      const uint32_t s = 8 * lane + k, f = freq[s];
      if (f > top_f) top_f = f, top_s = s;
    }
    group_argmax(&top_f, &top_s);
    const int32_t take = -d < static_cast<int32_t>(top_f) - 1 ? -d : static_cast<int32_t>(top_f) - 1;
    group_sync();
    if (lane == 0) freq[top_s] = static_cast<uint16_t>(top_f - take);
    group_sync();
    d += take;
  }
  group_sync();
}

// rans::write_table computed by the whole group; identical bytes. Returns its length.
PZ_DEVICE inline int write_table_group(const uint16_t* freq, uint8_t* out) {
  const int lane = group_lane();
  uint32_t lo = 256, hi = 0, bits = 0;
  for (int k = 0; k < 8; ++k) {
    const uint32_t s = 8 * lane + k;
    if (freq[s]) {
      bits |= 1u << k;
      lo = lo < s ? lo : s;
      hi = s;
    }
  }
#pragma unroll
  for (int m = 1; m < fmt::kLanes; m <<= 1) {
    const uint32_t olo = group_shfl_xor(lo, m), ohi = group_shfl_xor(hi, m);
    lo = olo < lo ? olo : lo;
    hi = ohi > hi ? ohi : hi;
  }
  uint32_t rb = 0, bb = 0;
  for (int k = 0; k < 8; ++k) {
    const uint32_t s = 8 * lane + k, vb = rans::varint_bytes(freq[s]);
    if (s >= lo && s <= hi) rb += vb;
    if (bits >> k & 1) bb += vb;
  }
  const uint32_t range_bytes = 2 + group_sum32(rb), bitmap_bytes = 32 + group_sum32(bb);
  const bool range = range_bytes <= bitmap_bytes;
  uint8_t* p = out + 1 + (range ? 2 + group_exclusive_scan(rb) : 32 + group_exclusive_scan(bb));
  for (int k = 0; k < 8; ++k) {
    const uint32_t s = 8 * lane + k;
    if (range ? (s >= lo && s <= hi) : (bits >> k & 1)) p = rans::put_varint(p, freq[s]);
  }
  if (lane == 0) {
    out[0] = range ? fmt::kTableRange : fmt::kTableBitmap;
    if (range) out[1] = static_cast<uint8_t>(lo), out[2] = static_cast<uint8_t>(hi);
  }
  if (!range) out[1 + lane] = static_cast<uint8_t>(bits);
  return static_cast<int>(1 + (range ? range_bytes : bitmap_bytes));
}

// Returns the exclusive prefix of block b's size over blocks 0..b-1.
PZ_DEVICE inline uint64_t lookback(uint64_t* status, uint64_t b, uint64_t size) {
  const int lane = group_lane();
  if (b == 0) {
    if (lane == 0) store_release_device(&status[0], kStatusPrefix | size);
    return 0;
  }
  if (lane == 0) store_release_device(&status[b], kStatusAggregate | size);
  uint64_t excl = 0;
  int64_t j = static_cast<int64_t>(b) - 1;
  while (true) {
    const int64_t idx = j - lane;
    uint64_t v = kStatusPrefix;  // before block 0: a prefix of 0
    if (idx >= 0) {
      do {
        v = load_acquire_device(&status[idx]);
      } while ((v >> 62) == 0);
    }
    const uint32_t pre = group_ballot((v >> 62) == 2);
    if (pre) {
      const int first = ffs32(pre) - 1;  // nearest predecessor holding a prefix
      excl += group_sum64(lane <= first ? (v & kStatusValue) : 0);
      break;
    }
    excl += group_sum64(v & kStatusValue);
    j -= fmt::kLanes;
  }
  if (lane == 0) store_release_device(&status[b], kStatusPrefix | (excl + size));
  return excl;
}

// The 8 symbols (and raw bits) of chunk [i, i+8) of the block starting at
// symbol `first`: one or two 16-byte loads. Needs the chunk fully in range and
// a 16-byte-aligned input.
template <fmt::DType D>
struct Chunk {
  uint32_t sym[2];
  uint32_t raw8[2];
  uint32_t raw16[4];
};

template <fmt::DType D>
struct RawChunk {
  uint4 v[kSymBytes<D> / 2];
};

template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE RawChunk<D> load_raw(const uint8_t* in, uint64_t sym_index) {
  RawChunk<D> r;
  const uint4* src = reinterpret_cast<const uint4*>(in + sym_index * kSymBytes<D>);
#pragma unroll
  for (int k = 0; k < kSymBytes<D> / 2; ++k) r.v[k] = src[k];
  return r;
}

template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE Chunk<D> split_chunk(const RawChunk<D>& r) {
  using T = FloatTraits<D>;
  union {
    uint4 v[kSymBytes<D> / 2];
    uint8_t b[8 * kSymBytes<D>];
  } u;
#pragma unroll
  for (int k = 0; k < kSymBytes<D> / 2; ++k) u.v[k] = r.v[k];
  Chunk<D> c{};
#pragma unroll
  for (int k = 0; k < kChunkSyms; ++k) {
    const Split sp = T::split(u.b, k, ~0ull);
    c.sym[k >> 2] |= uint32_t(sp.sym) << (8 * (k & 3));
    c.raw8[k >> 2] |= uint32_t(sp.raw8) << (8 * (k & 3));
    c.raw16[k >> 1] |= uint32_t(sp.raw16) << (16 * (k & 1));
  }
  return c;
}

// The v3 checksum terms of a loaded chunk: its 32-bit words, the first
// being word `index` of the tensor's bytes.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE uint32_t chunk_checksum(const RawChunk<D>& r, uint32_t index) {
  uint32_t s = 0;
#pragma unroll
  for (int j = 0; j < kSymBytes<D> / 2; ++j)
    s += fmt::hash_term(r.v[j].x, index + 4 * j) + fmt::hash_term(r.v[j].y, index + 4 * j + 1) +
         fmt::hash_term(r.v[j].z, index + 4 * j + 2) + fmt::hash_term(r.v[j].w, index + 4 * j + 3);
  return s;
}

template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE bool chunk_in_range(const fmt::Header& h, uint64_t first, uint32_t i, uint32_t n) {
  constexpr uint64_t E = (D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2) ? 2 : 1;
  return i + kChunkSyms <= n && (first + i + kChunkSyms) * E <= h.numel;
}

// A block whose every symbol has all its elements: no bounds tests needed.
// (fp8: the last symbol of an odd-sized tensor pairs with an implicit zero.)
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE bool full_block(const fmt::Header& h, uint64_t first, uint32_t n) {
  constexpr uint64_t E = (D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2) ? 2 : 1;
  return n == (1u << h.block_log2) && (first + n) * E <= h.numel;
}

// Byte 32k + lane of a 256-byte row held as 8 consecutive bytes per lane
// (lo, hi): the row-to-step redistribution of both the rANS encoder and the
// fixed-code decoder (two shuffles and a byte select).
PZ_DEVICE PZ_FORCE_INLINE uint32_t row_byte(uint32_t lo, uint32_t hi, int k) {
  const int lane = group_lane();
  const int src = k * (fmt::kLanes / kChunkSyms) + (lane >> 3);
  const uint32_t wlo = group_shfl(lo, src), whi = group_shfl(hi, src);
  return (((lane & 7) < 4 ? wlo : whi) >> (8 * (lane & 3))) & 0xff;
}

// Pass 2 driver: calls f(idx, sym, valid) for the block's symbols step by
// step, 8 steps per 256-symbol row, and row_done() after each row, stopping
// when it returns true (group-uniform). A row is loaded as one 8-symbol chunk
// per lane. Contig (format v3 rANS): lane L codes its own chunk, symbol
// row + 8L + k at step k, straight from its registers. Otherwise (v1/v2
// layout, the fixed code) the chunks are redistributed with shuffles so lane
// L gets symbol row + 32k + L. The next two rows' chunks are in flight while
// a row is coded. Steps have no branches (a full block has no bounds tests at
// all), so the compiler can overlap one step's symbol fetch with the previous
// step's state update.
template <fmt::DType D, bool Aligned, bool Full, bool Contig, class F, class R>
PZ_DEVICE PZ_FORCE_INLINE void for_each_step(const CompressParams& p, uint64_t first, uint32_t n, F&& f, R&& row_done) {
  using T = FloatTraits<D>;
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  constexpr uint32_t kRow = fmt::kLanes * kChunkSyms;
  static_assert(kChunkSyms == fmt::kLaneRun, "a v3 lane's run is one chunk");
  RawChunk<D> next1{}, next2{};
  auto in_range = [&](uint32_t i) { return Full ? i + kChunkSyms <= n : chunk_in_range<D>(h, first, i, n); };
  if (Aligned && in_range(lane * kChunkSyms)) next1 = load_raw<D>(p.in, first + lane * kChunkSyms);
  if (Aligned && in_range(kRow + lane * kChunkSyms)) next2 = load_raw<D>(p.in, first + kRow + lane * kChunkSyms);
  for (uint32_t row = 0; row < n; row += kRow) {
    uint32_t lo = 0, hi = 0;
    const uint32_t mine = row + lane * kChunkSyms;
    const bool vec = Aligned && in_range(mine);
    const RawChunk<D> cur = next1;
    next1 = next2;
    const uint32_t ahead = mine + 2 * kRow;
    if (Aligned && in_range(ahead)) next2 = load_raw<D>(p.in, first + ahead);
    if (vec) {
      const Chunk<D> c = split_chunk<D>(cur);
      lo = c.sym[0];
      hi = c.sym[1];
    } else {
      for (int k = 0; k < kChunkSyms; ++k)
        if (mine + k < n) {
          const uint32_t sy = T::split(p.in, first + mine + k, h.numel).sym;
          (k < 4 ? lo : hi) |= sy << (8 * (k & 3));
        }
    }
#pragma unroll
    for (int k = 0; k < kChunkSyms; ++k) {
      if constexpr (Contig) {
        const uint32_t idx = mine + k;
        f(idx, ((k < 4 ? lo : hi) >> (8 * (k & 3))) & 0xff, Full || idx < n);
      } else {
        const uint32_t idx = row + k * fmt::kLanes + lane;
        f(idx, row_byte(lo, hi, k), Full || idx < n);
      }
    }
    if (row_done()) break;
  }
}

// Where a block's segment is at look-back time. Staged: all of it is in the
// staging buffer. Stored: nothing is (the symbols are split again at copy-out).
// Overflow: the prefix is staged and the coded body is encoded again into the
// output.
enum SegmentKind : uint32_t { kStaged = 0, kStoredLate = 1, kOverflow = 2 };
struct Segment {
  uint32_t used;    // bytes before padding
  uint32_t kind;
  uint32_t prefix;  // rANS: bytes before the words
};

// The rANS encode loop: words go to wbuf while below cap (a word count past
// the block's limit makes it stored). Returns the final states and the total
// word count; *stored tells whether the words reached the limit.
template <fmt::DType D, bool Aligned>
PZ_DEVICE PZ_FORCE_INLINE void rans_loop(const CompressParams& p, uint64_t first, uint32_t n, const uint2* enc,
                                         uint16_t* wbuf, uint32_t cap, uint32_t prefix, uint32_t limit, uint32_t* x_out,
                                         uint32_t* words_out, bool* stored) {
  const uint32_t lt = group_lanemask_lt();
  uint32_t x = fmt::kStateLow, words = 0;
  auto step = [&](uint32_t, uint32_t sym, bool valid) {
    const uint2 e = enc[sym];
    const uint32_t f = e.x & 0x1fff;
    const bool need = valid && (x >> (32 - fmt::kProbBits)) >= f;  // rans::enc_renorm_needed, in 32 bits
    const uint32_t ballot = group_ballot(need);
    const uint32_t pos = words + popc32(ballot & lt);
    if (need && pos < cap) wbuf[pos] = static_cast<uint16_t>(x);
    x = need ? x >> 16 : x;
    words += popc32(ballot);
    const uint32_t y = rans::enc_put_magic(x, f, (e.x >> 13) & 0xfff, rans::DivMagic{e.y, e.x >> 25});
    x = valid ? y : x;
  };
  auto row_done = [&] { return *stored = prefix + 2 * words >= limit; };
  if (full_block<D>(p.h, first, n)) for_each_step<D, Aligned, true, true>(p, first, n, step, row_done);
  else for_each_step<D, Aligned, false, true>(p, first, n, step, row_done);
  *x_out = x;
  *words_out = words;
}

// rANS body of a block: table and encode table, then the encode into the
// staging buffer (words past it are counted, not written).
template <fmt::DType D, bool Aligned>
PZ_DEVICE Segment encode_rans(const CompressParams& p, uint64_t first, uint32_t n, const uint32_t* counts, uint2* enc,
                              uint16_t* freq, uint8_t* buf) {
  const int lane = group_lane();
  quantize_group(counts, n, freq);
  const int table_bytes = write_table_group(freq, buf + 1);
  // Cumulative frequencies: lane L owns symbols 8L..8L+7.
  uint32_t f8[8], local = 0;
  for (int k = 0; k < 8; ++k) f8[k] = freq[8 * lane + k], local += f8[k];
  uint32_t cum = group_exclusive_scan(local);
  for (int k = 0; k < 8; ++k) {
    const rans::DivMagic d = rans::div_magic(f8[k]);
    enc[8 * lane + k] = make_uint2(f8[k] | (cum << 13) | (d.shift << 25), d.magic);
    cum += f8[k];
  }
  group_sync();
  // 32-bit bookkeeping: a segment is at most 1 + 2^14 bytes.
  const uint32_t prefix = rans::rans_prefix_bytes(table_bytes);
  const uint32_t limit = 1u + n;
  if (prefix >= limit) return {0, kStoredLate, 0};
  const uint32_t room = kStagingBytes > prefix ? (kStagingBytes - prefix) / 2 : 0;
  uint32_t x, words;
  bool stored = false;
  rans_loop<D, Aligned>(p, first, n, enc, reinterpret_cast<uint16_t*>(buf + prefix), room, prefix, limit, &x, &words,
                        &stored);
  if (stored) return {0, kStoredLate, 0};
  const uint32_t wpos = static_cast<uint32_t>(fmt::align_up(1 + table_bytes, 4));
  if (lane == 0) {
    buf[0] = fmt::kModeRans;
    for (uint32_t i = 1 + table_bytes; i < wpos; ++i) buf[i] = 0;
    put_u32(buf + wpos, words);
  }
  reinterpret_cast<uint32_t*>(buf + wpos + 4)[lane] = x;
  const uint32_t used = prefix + 2 * words;  // < limit
  return {used, used <= kStagingBytes ? kStaged : kOverflow, prefix};
}

// The fixed code's bit planes and escapes of one block, written to planes/esc.
template <fmt::DType D, bool Aligned>
PZ_DEVICE PZ_FORCE_INLINE void fixed_loop(const CompressParams& p, uint64_t first, uint32_t n, const uint8_t* code,
                                          uint32_t* planes, uint8_t* esc) {
  const int lane = group_lane();
  const uint32_t lt = group_lanemask_lt();
  uint32_t e = 0;
  auto step = [&](uint32_t idx, uint32_t sym, bool valid) {
    const uint32_t c = valid ? code[sym] : 0;
    const uint32_t b0 = group_ballot(c & 1), b1 = group_ballot(c & 2), b2 = group_ballot(c & 4);
    const uint32_t eb = group_ballot(c == fmt::kFixedEscape);
    // Steps past the block's end (the tail of its last row) have no planes:
    // their bytes belong to the escapes.
    if (lane < 3 && idx - lane < n) planes[3 * (idx / fmt::kLanes) + lane] = lane == 0 ? b0 : lane == 1 ? b1 : b2;
    if (c == fmt::kFixedEscape) esc[e + popc32(eb & lt)] = static_cast<uint8_t>(sym);
    e += popc32(eb);
  };
  auto never = [] { return false; };
  if (full_block<D>(p.h, first, n)) for_each_step<D, Aligned, true, false>(p, first, n, step, never);
  else for_each_step<D, Aligned, false, false>(p, first, n, step, never);
}

// Fixed-code body of a block (block.h: fixed_table; docs/FORMAT.md): the
// 12-byte prefix goes to buf, the body too when it fits. code: 256 bytes.
template <fmt::DType D, bool Aligned>
PZ_DEVICE Segment encode_fixed(const CompressParams& p, uint64_t first, uint32_t n, const uint32_t* counts,
                               uint8_t* code, uint8_t* buf) {
  const int lane = group_lane();
  // The 7 most frequent symbols, count descending then symbol ascending; lane
  // L owns symbols 8L..8L+7 and lane c ends up holding the table's entry c.
  uint32_t c8[8], taken = 0, tab = 0, top = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) c8[k] = counts[8 * lane + k];
  for (int c = 0; c < fmt::kFixedCodes; ++c) {
    uint32_t bv = 0, bs = 256;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (!(taken >> k & 1) && (bs == 256 || c8[k] > bv)) bv = c8[k], bs = 8 * lane + k;
    group_argmax(&bv, &bs);
    if ((bs >> 3) == static_cast<uint32_t>(lane)) taken |= 1u << (bs & 7);
    if (lane == c) tab = bs;
    top += bv;
  }
  const uint64_t escapes = n - top;
  const uint64_t size = fixed_segment_bytes(n, escapes);
  if (size >= 1ull + n) return {0, kStoredLate, 0};
  for (int s = lane; s < 256; s += fmt::kLanes) code[s] = fmt::kFixedEscape;
  group_sync();
  if (lane < fmt::kFixedCodes) {
    code[tab] = static_cast<uint8_t>(lane);
    buf[1 + lane] = static_cast<uint8_t>(tab);
  }
  if (lane == 0) {
    buf[0] = fmt::kModeFixed;
    put_u32(buf + 8, static_cast<uint32_t>(escapes));
  }
  group_sync();
  if (size > kStagingBytes) return {static_cast<uint32_t>(size), kOverflow, fmt::kFixedPrefixBytes};
  fixed_loop<D, Aligned>(p, first, n, code, reinterpret_cast<uint32_t*>(buf + fmt::kFixedPrefixBytes),
                         buf + fmt::kFixedPrefixBytes + fmt::fixed_planes_bytes(n));
  return {static_cast<uint32_t>(size), kStaged, fmt::kFixedPrefixBytes};
}

// Encodes block b into the group's staging buffer (split, histogram, table,
// coded body) and writes its raw planes. Returns where its segment is.
template <fmt::DType D, bool Aligned, fmt::Codec C>
PZ_DEVICE Segment encode_block(const CompressParams& p, const fmt::Layout& l, uint64_t b, uint8_t* base) {
  using T = FloatTraits<D>;
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  uint2* enc = reinterpret_cast<uint2*>(base);                   // [256]
  uint16_t* freq = reinterpret_cast<uint16_t*>(enc + 256);        // [256]
  uint8_t* buf = reinterpret_cast<uint8_t*>(freq + 256);          // staging
  uint32_t* hist = reinterpret_cast<uint32_t*>(buf);              // [128 words][16 replicas]
  uint32_t* counts = reinterpret_cast<uint32_t*>(enc);            // [256], until enc is built
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);

  // Pass 1: split, histogram, raw planes. Two lanes see at most 2^14 / 16
  // symbols of a block, so two 16-bit counters share a word.
  group_sync();  // the previous block's segment has left the staging buffer
  for (uint32_t i = lane; i < kHistBytes / 16; i += fmt::kLanes) reinterpret_cast<uint4*>(hist)[i] = make_uint4(0, 0, 0, 0);
  group_sync();
  auto count = [&](uint32_t sym) {
    atomic_add<Scope::Block>(&hist[(sym >> 1) * kHistReplicas + (lane & (kHistReplicas - 1))], 1u << (16 * (sym & 1)));
  };
  uint32_t scalar_from = 0;
  uint32_t sum = 0;  // this lane's share of the block checksum (v3: words)
  if (Aligned) {
    // Software pipeline: the next two rows are in flight while two are consumed.
    constexpr uint32_t kRow = fmt::kLanes * kChunkSyms;
    auto row_full = [&](uint32_t row) { return chunk_in_range<D>(h, first, row + (fmt::kLanes - 1) * kChunkSyms, n); };
    auto consume = [&](uint32_t i, const RawChunk<D>& r) {
      const Chunk<D> c = split_chunk<D>(r);
      sum += chunk_checksum<D>(r, static_cast<uint32_t>((first + i) * kSymBytes<D> / 4));
#pragma unroll
      for (int k = 0; k < kChunkSyms; ++k) count((c.sym[k >> 2] >> (8 * (k & 3))) & 0xff);
      *reinterpret_cast<uint2*>(p.out + l.raw_begin + first + i) = make_uint2(c.raw8[0], c.raw8[1]);
      if (plane16)
        *reinterpret_cast<uint4*>(p.out + l.plane16_begin + 2 * (first + i)) =
            make_uint4(c.raw16[0], c.raw16[1], c.raw16[2], c.raw16[3]);
    };
    const uint32_t mine = lane * kChunkSyms;
    uint32_t row = 0;
    bool fa = row_full(0), fb = fa && row_full(kRow);
    RawChunk<D> a{}, bb{};
    if (fa) a = load_raw<D>(p.in, first + mine);
    if (fb) bb = load_raw<D>(p.in, first + kRow + mine);
    while (fb) {
      const uint32_t next = row + 2 * kRow;
      const bool na = row_full(next), nb = na && row_full(next + kRow);
      RawChunk<D> c{}, d{};
      if (na) c = load_raw<D>(p.in, first + next + mine);
      if (nb) d = load_raw<D>(p.in, first + next + kRow + mine);
      consume(row + mine, a);
      consume(row + kRow + mine, bb);
      a = c, bb = d, row = next, fa = na, fb = nb;
    }
    if (fa) {
      consume(row + mine, a);
      row += kRow;
    }
    scalar_from = row;
  }
  for (uint32_t i = scalar_from + lane; i < n; i += fmt::kLanes) {
    const Split sp = T::split(p.in, first + i, h.numel);
    count(sp.sym);
    write_raw(p.out, l, plane16, first + i, sp);
  }
  {  // the words of the symbols pass 1 did not load as vectors
    uint64_t lo, hi, len;
    block_words(h, first + scalar_from, n - scalar_from, &lo, &hi, &len);
    for (uint64_t k = lo + lane; k < hi; k += fmt::kLanes) sum += fmt::hash_term(raw_word(p.in, k, len), static_cast<uint32_t>(k));
  }
  sum = fmt::finish_checksum(group_sum32(sum));
  if (l.nsums && lane == 0) *reinterpret_cast<uint32_t*>(p.out + l.sums_begin + 4 * b) = sum;  // 4-byte aligned
  group_sync();
  // Merge: lane L sums words 4L..4L+3 over the 16 histograms, starting at its
  // own so that lanes read different banks.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t w = 4 * lane + j;
    uint32_t sum = 0;
    for (uint32_t r = 0; r < kHistReplicas; ++r) sum += hist[w * kHistReplicas + ((r + lane) & (kHistReplicas - 1))];
    counts[2 * w] = sum & 0xffff;
    counts[2 * w + 1] = sum >> 16;
  }
  group_sync();
  Segment seg;
  if constexpr (C == fmt::Codec::Fixed) seg = encode_fixed<D, Aligned>(p, first, n, counts, reinterpret_cast<uint8_t*>(freq), buf);
  else seg = encode_rans<D, Aligned>(p, first, n, counts, enc, freq, buf);
  group_sync();
  if (seg.kind == kStaged)  // zero padding, copied out with the segment
    for (uint32_t i = seg.used + lane; i < fmt::align_up(seg.used, fmt::kAlign); i += fmt::kLanes) buf[i] = 0;
  group_sync();
  return seg;
}

// Writes block b's segment at dst (16-byte aligned): from the staging buffer,
// or split again (stored), or the staged prefix plus a second encode of the
// body (overflow). Zero padding to `padded`.
template <fmt::DType D, bool Aligned, fmt::Codec C>
PZ_DEVICE void write_segment(const CompressParams& p, const fmt::Layout& l, uint64_t b, const uint8_t* base, Segment seg,
                             uint64_t padded, uint8_t* dst) {
  using T = FloatTraits<D>;
  const int lane = group_lane();
  const uint2* enc = reinterpret_cast<const uint2*>(base);
  const uint8_t* code = base + 256 * 8;
  const uint8_t* buf = base + kCompressTableBytes;
  const uint64_t first = b << p.h.block_log2;
  const uint32_t n = fmt::block_symbols(p.h, l, b);
  uint32_t used = seg.used;
  if (seg.kind == kStaged) {
    for (uint64_t i = lane; i < padded / 16; i += fmt::kLanes)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(buf)[i];
    return;
  }
  if (seg.kind == kStoredLate) {
    if (lane == 0) dst[0] = fmt::kModeStored;
    for (uint32_t i = lane; i < n; i += fmt::kLanes) dst[1 + i] = T::split(p.in, first + i, p.h.numel).sym;
    used = 1 + n;
  } else if constexpr (C == fmt::Codec::Fixed) {
    for (uint32_t i = lane; i < fmt::kFixedPrefixBytes; i += fmt::kLanes) dst[i] = buf[i];
    fixed_loop<D, Aligned>(p, first, n, code, reinterpret_cast<uint32_t*>(dst + fmt::kFixedPrefixBytes),
                           dst + fmt::kFixedPrefixBytes + fmt::fixed_planes_bytes(n));
  } else {
    // The prefix (a multiple of 4 bytes) is staged; the same loop, fed the
    // same symbols, writes the same words, now all of them, into place.
    for (uint32_t i = lane; i < seg.prefix / 4; i += fmt::kLanes)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(buf)[i];
    const uint32_t words = (used - seg.prefix) / 2;
    uint32_t x, w;
    bool stored = false;
    rans_loop<D, Aligned>(p, first, n, enc, reinterpret_cast<uint16_t*>(dst + seg.prefix), words, seg.prefix, 1u + n,
                          &x, &w, &stored);
  }
  for (uint64_t i = used + lane; i < padded; i += fmt::kLanes) dst[i] = 0;
}

// One ticket of one tensor: encode its blocks, look back, write the segments.
template <fmt::DType D, bool Aligned, fmt::Codec C>
PZ_DEVICE PZ_FORCE_INLINE void compress_ticket(const CompressParams& p, uint64_t ticket, uint8_t* smem,
                                               uint64_t* cta_size, uint64_t* cta_excl) {
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const fmt::Layout l = fmt::layout_of(h);
  const int lane = group_lane();
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  uint8_t* base = smem + group * compress_smem_per_group(h.block_log2);
    const uint64_t b = ticket * kGroupsPerCta + group;
    const bool active = b < l.nblocks;
    Segment seg{0, kStaged, 0};
    if (active) seg = encode_block<D, Aligned, C>(p, l, b, base);
    const uint64_t padded = !active ? 0
                            : seg.kind == kStoredLate ? fmt::max_segment_bytes(fmt::block_symbols(h, l, b))
                                                      : fmt::align_up(seg.used, fmt::kAlign);
    if (lane == 0) cta_size[group] = padded;
    __syncthreads();
    if (group == 0) {
      uint64_t agg = 0;
      for (int g = 0; g < kGroupsPerCta; ++g) agg += cta_size[g];
      const uint64_t excl = lookback(p.status, ticket, agg);
      if (lane == 0) *cta_excl = excl;
    }
    __syncthreads();
    if (active) {
      uint64_t excl = *cta_excl;
      for (int g = 0; g < group; ++g) excl += cta_size[g];
      write_segment<D, Aligned, C>(p, l, b, base, seg, padded, p.out + l.coded_begin + excl);
      if (lane == 0) *reinterpret_cast<uint64_t*>(p.out + l.offsets_begin + 8 * b) = excl + padded;
      if (b == 0) {
        // Header (minus the total, which the last block owns) and the zero gaps.
        // (The last block owns the total and the header checksum.)
        for (uint64_t i = lane; i < l.raw_begin; i += fmt::kLanes)
          if (i < 8 || (i >= 16 && i < fmt::kHeaderSumOffset) || i >= fmt::kHeaderSumOffset + 4) p.out[i] = p.header[i];
        for (uint64_t i = l.raw_begin + l.nsym + lane; i < l.plane16_begin && plane16; i += fmt::kLanes) p.out[i] = 0;
        for (uint64_t i = l.raw_end + lane; i < l.offsets_begin; i += fmt::kLanes) p.out[i] = 0;
        for (uint64_t i = l.sums_begin + 4 * l.nsums + lane; i < l.coded_begin; i += fmt::kLanes) p.out[i] = 0;
      }
      if (b + 1 == l.nblocks) {  // group-uniform
        const uint64_t total = l.coded_begin + excl + padded;
        uint32_t hsum = 0;
        for (uint32_t k = lane; k < l.header_bytes / 4; k += fmt::kLanes)
          hsum += fmt::hash_term(fmt::header_word(p.header, k, total), k);
        hsum = fmt::finish_checksum(group_sum32(hsum));
        if (lane == 0) {
          for (int i = 0; i < 8; ++i) p.out[8 + i] = static_cast<uint8_t>(total >> (8 * i));
          put_u32(p.out + fmt::kHeaderSumOffset, h.version >= 2 ? hsum : 0u);
        }
      }
    }
}

// A persistent CTA takes tickets until the blocks run out. Single tensor:
// ticket t encodes blocks t*kGroupsPerCta + group, its parameters read from
// the launch itself. Batched: the ticket first picks its tensor, whose
// parameters are staged in shared memory. Tickets are handed out in order,
// so every look-back waits only on CTAs already running. The look-back runs
// per CTA, by group 0 only: on wave64 both groups share one wave, so no group
// may spin on a result its wave-mate has yet to produce.
template <fmt::DType D, bool Aligned, fmt::Codec C, bool Batched>
PZ_DEVICE PZ_FORCE_INLINE void compress_kernel(CompressLaunch launch) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t cta_ticket;
  __shared__ uint64_t cta_size[kGroupsPerCta];
  __shared__ uint64_t cta_excl;
  if constexpr (!Batched) {
    const uint64_t tickets = (fmt::layout_of(launch.one.h).nblocks + kGroupsPerCta - 1) / kGroupsPerCta;
    for (;;) {
      if (threadIdx.x == 0) cta_ticket = atomic_add<Scope::Device>(launch.ticket, 1u);
      __syncthreads();
      const uint64_t ticket = cta_ticket;
      if (ticket >= tickets) return;  // CTA-uniform
      compress_ticket<D, Aligned, C>(launch.one, ticket, smem, cta_size, &cta_excl);
      __syncthreads();  // cta_ticket, cta_size and the staging buffers are reused
    }
  } else {
    __shared__ __align__(16) uint8_t job_bytes[sizeof(CompressParams)];  // raw: Header is not trivially constructible
    CompressParams& job = *reinterpret_cast<CompressParams*>(job_bytes);
    const uint64_t total = launch.ticket_end[launch.njobs - 1];
    uint32_t current = ~0u;
    for (;;) {
      if (threadIdx.x == 0) cta_ticket = atomic_add<Scope::Device>(launch.ticket, 1u);
      __syncthreads();
      uint64_t ticket = cta_ticket;
      if (ticket >= total) return;  // CTA-uniform
      uint32_t lo = 0, hi = launch.njobs - 1;  // the first tensor whose end is past the ticket
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (launch.ticket_end[mid] > ticket) hi = mid;
        else lo = mid + 1;
      }
      if (lo > 0) ticket -= launch.ticket_end[lo - 1];
      if (lo != current) {
        for (uint32_t i = threadIdx.x; i < sizeof(CompressParams) / 4; i += blockDim.x)
          reinterpret_cast<uint32_t*>(job_bytes)[i] = reinterpret_cast<const uint32_t*>(&launch.jobs[lo])[i];
        current = lo;
        __syncthreads();
      }
      compress_ticket<D, Aligned, C>(job, ticket, smem, cta_size, &cta_excl);
      __syncthreads();  // cta_ticket, cta_size, job and the staging buffers are reused
    }
  }
}

// Symbol sym's element bytes as one little-endian integer (fp8: the pair,
// both elements), from its symbol and raw bits.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE uint32_t element_unit(uint32_t sym, uint32_t raw8, uint32_t raw16) {
  using T = FloatTraits<D>;
  if constexpr (D == fmt::DType::Float32) {
    return ((raw8 & 0x80) << 24) | (sym << 23) | ((raw8 & 0x7f) << 16) | (raw16 & 0xffff);
  } else if constexpr (D == fmt::DType::BFloat16 || D == fmt::DType::Float16) {
    uint8_t b[2];
    T::join(b, 0, 1, static_cast<uint8_t>(sym), static_cast<uint8_t>(raw8), 0);
    return b[0] | (uint32_t(b[1]) << 8);
  } else {
    return T::unsplit(sym & 0xf, raw8 & 0xf) | (uint32_t(T::unsplit(sym >> 4, raw8 >> 4)) << 8);
  }
}

// Writes symbol i's element(s) with one store of the element's width (the
// output tensor is aligned to its dtype); fp8 pairs go byte by byte. Returns
// the symbol's element bytes as FloatTraits::unit reads them (for the
// checksum), from registers: no load of what was just stored.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE uint32_t store_element(uint8_t* out, uint64_t i, uint64_t numel, uint8_t sym, uint8_t raw8,
                                                 uint16_t raw16) {
  const uint32_t w = element_unit<D>(sym, raw8, raw16);
  if constexpr (D == fmt::DType::Float32) {
    reinterpret_cast<uint32_t*>(out)[i] = w;
    return w;
  } else if constexpr (D == fmt::DType::BFloat16 || D == fmt::DType::Float16) {
    reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(w);
    return w;
  } else {
    const bool pair = 2 * i + 1 < numel;
    out[2 * i] = static_cast<uint8_t>(w);
    if (pair) out[2 * i + 1] = static_cast<uint8_t>(w >> 8);
    return pair ? w : w & 0xff;
  }
}

// Symbol i's share of its block checksum, for symbols laid out one per lane
// in order (lane pairs 2m, 2m+1 hold an even and an odd symbol). v1/v2 hash
// one unit per symbol; v3 hashes 32-bit words, so for 2-byte symbols the even
// lane hashes the pair. Every lane calls it (v3 shuffles).
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE uint32_t symbol_term(bool contig, uint32_t unit, uint64_t i, bool valid) {
  if (!contig || kSymBytes<D> == 4) return valid ? fmt::hash_term(unit, static_cast<uint32_t>(i)) : 0u;
  const uint32_t odd = group_shfl_xor(valid ? unit : 0u, 1);
  return valid && !(i & 1) ? fmt::hash_term(unit | odd << 16, static_cast<uint32_t>(i / 2)) : 0u;
}

// Decodes a fixed-code segment: no tables and no sequential state but the
// escape count, so it is a streaming loop. A batch of 8 steps (256 symbols)
// arrives as one 32-bit plane word per lane (lanes 0..23: the batch's 24 plane
// words) and 8 raw bytes per lane, redistributed with shuffles; the next
// batch's loads are in flight while one is decoded.
template <fmt::DType D>
PZ_DEVICE uint32_t decode_fixed(const DecompressParams& p, const uint8_t* seg, uint64_t seglen, uint64_t first,
                                uint32_t n, const uint8_t* raw8, const uint16_t* raw16, bool contig, uint32_t& sum) {
  constexpr bool plane16 = fmt::has_plane16(D);
  constexpr uint32_t kBatch = 8;
  const int lane = group_lane();
  if (seglen < fmt::kFixedPrefixBytes) return kErrSegment;
  const uint64_t escapes = get_u32(seg + 8);
  if (fixed_segment_bytes(n, escapes) > seglen) return kErrSegment;
  const uint32_t tab = lane < fmt::kFixedCodes ? seg[1 + lane] : 0;
  const uint32_t* planes = reinterpret_cast<const uint32_t*>(seg + fmt::kFixedPrefixBytes);  // 4-byte aligned
  const uint8_t* esc = seg + fmt::kFixedPrefixBytes + fmt::fixed_planes_bytes(n);
  const uint32_t steps = (n + fmt::kLanes - 1) / fmt::kLanes;
  const uint32_t lt = group_lanemask_lt();
  struct Batch {
    uint32_t plane, lo, hi;
    uint16_t r16[kBatch];
  };
  auto load = [&](uint32_t s0, Batch& bt) {
    bt.plane = bt.lo = bt.hi = 0;
    if (s0 + lane / 3 < steps && lane < 3 * static_cast<int>(kBatch)) bt.plane = planes[3 * s0 + lane];
    const uint32_t base = s0 * fmt::kLanes + 8 * lane;  // this lane's 8 raw bytes (8-byte aligned)
    if (base + 8 <= n) {
      const uint2 v = *reinterpret_cast<const uint2*>(raw8 + base);
      bt.lo = v.x, bt.hi = v.y;
    } else {
      for (int j = 0; j < 8; ++j)
        if (base + j < n) (j < 4 ? bt.lo : bt.hi) |= uint32_t(raw8[base + j]) << (8 * (j & 3));
    }
    if (plane16)
      for (uint32_t k = 0; k < kBatch; ++k) {
        const uint32_t idx = (s0 + k) * fmt::kLanes + lane;
        bt.r16[k] = idx < n ? raw16[idx] : 0;
      }
  };
  uint64_t e = 0;
  Batch cur, nxt;
  load(0, cur);
  for (uint32_t s0 = 0; s0 < steps; s0 += kBatch) {
    if (s0 + kBatch < steps) load(s0 + kBatch, nxt);
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t s = s0 + k, idx = s * fmt::kLanes + lane;
      if (s >= steps) continue;  // group-uniform
      const uint32_t p0 = group_shfl(cur.plane, 3 * k), p1 = group_shfl(cur.plane, 3 * k + 1),
                     p2 = group_shfl(cur.plane, 3 * k + 2);
      const uint32_t code = (p0 >> lane & 1) | (p1 >> lane & 1) << 1 | (p2 >> lane & 1) << 2;
      const uint32_t r8 = row_byte(cur.lo, cur.hi, static_cast<int>(k));
      const bool valid = idx < n, is_esc = valid && code == fmt::kFixedEscape;
      const uint32_t eb = group_ballot(is_esc);
      const uint32_t sym = group_shfl(tab, static_cast<int>(code));
      if (e + popc32(eb) > escapes) return kErrStream;  // group-uniform
      uint32_t unit = 0;
      if (valid)
        unit = store_element<D>(p.out, first + idx, p.h.numel, is_esc ? esc[e + popc32(eb & lt)] : sym,
                                static_cast<uint8_t>(r8), cur.r16[k]);
      sum += symbol_term<D>(contig, unit, first + idx, valid);
      e += popc32(eb);
    }
    cur = nxt;
  }
  return e == escapes ? 0 : kErrStream;
}

// One rANS decode step of this lane's state x (valid: the lane holds a
// symbol at this step), then the group's renormalization from the coded
// words read backwards from wp[rp). Returns the symbol (0 if not valid). A
// word-count underflow (corrupt stream) sets bad, reads nothing and leaves
// the read position at 0, so reads stay inside the words.
PZ_DEVICE PZ_FORCE_INLINE uint32_t decode_step(uint32_t& x, bool valid, const uint8_t* lookup, const uint32_t* encsym,
                                               const uint16_t* wp, uint32_t lt, uint32_t& rp, bool& bad) {
  uint32_t sym = 0;
  if (valid) {
    const uint32_t slot = x & (fmt::kProbScale - 1);
    sym = lookup[slot];
    const uint32_t es = encsym[sym];
    x = (es & 0xffff) * (x >> fmt::kProbBits) + slot - (es >> 16);  // rans::dec_step
  }
  const bool need = valid && x < fmt::kStateLow;
  const uint32_t ballot = group_ballot(need);
  const uint32_t count = popc32(ballot);
  const bool under = count > rp;  // group-uniform
  bad |= under;
  // Out of words (a corrupt stream): no read at all (wp may end the stream).
  if (need && !under) x = (x << 16) | wp[rp - count + popc32(ballot & lt)];
  rp = under ? 0 : rp - count;
  return sym;
}

// The v1/v2 rANS decode loop of one block (symbol 32s + L on lane L at step
// s), from the last step to the first. Raw
// bits for the next row of 8 steps are loaded while this row decodes (their
// global latency stays off the state chain). A word-count underflow (corrupt
// stream) is recorded and the read position clamped, so reads stay inside
// the segment without a branch. Returns false when the words do not add up.
template <fmt::DType D, bool Full>
PZ_DEVICE PZ_FORCE_INLINE bool rans_strided(const DecompressParams& p, uint64_t first, uint32_t n, const uint8_t* lookup,
                                          const uint32_t* encsym, const uint16_t* wp, uint32_t words,
                                          const uint8_t* raw8, const uint16_t* raw16, uint32_t& x_io, uint32_t& sum) {
  constexpr bool plane16 = fmt::has_plane16(D);
  constexpr int kRowSteps = 8;
  const int lane = group_lane();
  const uint32_t lt = group_lanemask_lt();
  const uint32_t steps = (n + fmt::kLanes - 1) / fmt::kLanes;
  const int32_t rows = static_cast<int32_t>((steps + kRowSteps - 1) / kRowSteps);
  const uint8_t* r8 = raw8 + lane;
  const uint16_t* r16 = raw16 + lane;
  uint32_t x = x_io, rp = words;
  bool bad = false;
  uint8_t cur8[kRowSteps] = {}, nxt8[kRowSteps] = {};
  uint16_t cur16[kRowSteps] = {}, nxt16[kRowSteps] = {};
  auto load_row = [&](int32_t r, uint8_t* v8, uint16_t* v16) {
#pragma unroll
    for (int k = 0; k < kRowSteps; ++k) {
      const uint32_t off = static_cast<uint32_t>(r * kRowSteps + k) * fmt::kLanes;
      if (Full || off + lane < n) {
        v8[k] = r8[off];
        if (plane16) v16[k] = r16[off];
      }
    }
  };
  load_row(rows - 1, cur8, cur16);
  for (int32_t r = rows - 1; r >= 0; --r) {
    if (r > 0) load_row(r - 1, nxt8, nxt16);
    // Pull the coded words of the next rows toward L1 (about 40 words a row).
    if (lane < 2 && rp > 64u * (lane + 1)) prefetch_l1(wp + rp - 64u * (lane + 1));  // inside the words
#pragma unroll
    for (int k = kRowSteps - 1; k >= 0; --k) {
      const uint32_t s = static_cast<uint32_t>(r * kRowSteps + k);
      if (!Full && s >= steps) continue;  // group-uniform: only in the last row
      const uint32_t idx = s * fmt::kLanes + lane;
      const bool valid = Full || idx < n;
      const uint32_t sym = decode_step(x, valid, lookup, encsym, wp, lt, rp, bad);
      // The checksum term is off the state chain: it overlaps the next step.
      if (valid)
        sum += fmt::hash_term(store_element<D>(p.out, first + idx, p.h.numel, static_cast<uint8_t>(sym), cur8[k],
                                               cur16[k]),
                              static_cast<uint32_t>(first + idx));  // v2: one unit per symbol
    }
#pragma unroll
    for (int k = 0; k < kRowSteps; ++k) cur8[k] = nxt8[k], cur16[k] = nxt16[k];
  }
  x_io = x;
  return !bad && rp == 0;
}

// The v3 rANS decode loop of one block: lane L decodes symbols row + 8L + 7
// down to row + 8L of each 256-symbol row, last row first, into registers,
// then writes its 8 elements with one or two 16-byte stores and hashes their
// words for the checksum. The raw bits of the next row (one 8-byte load, fp32
// two more 16-byte loads) are in flight while a row decodes. A word-count
// underflow (corrupt stream) is recorded and the read position clamped, so
// reads stay inside the segment without a branch. Returns false when the
// words do not add up.
template <fmt::DType D, bool Full>
PZ_DEVICE PZ_FORCE_INLINE bool rans_rows(const DecompressParams& p, uint64_t first, uint32_t n, const uint8_t* lookup,
                                         const uint32_t* encsym, const uint16_t* wp, uint32_t words,
                                         const uint8_t* raw8, const uint16_t* raw16, uint32_t& x_io, uint32_t& sum) {
  constexpr bool plane16 = fmt::has_plane16(D);
  constexpr int R = fmt::kLaneRun;
  constexpr int kWords = R * kSymBytes<D> / 4;  // output words per lane per row
  const int lane = group_lane();
  const uint32_t lt = group_lanemask_lt();
  const int32_t rows = static_cast<int32_t>((n + fmt::kRowSymbols - 1) / fmt::kRowSymbols);
  const bool vec_out = (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;  // group-uniform
  uint32_t x = x_io, rp = words;
  bool bad = false;
  struct Raw {
    uint2 r8;
    uint4 r16[plane16 ? 2 : 1];
  };
  auto load = [&](int32_t r, Raw& v) {
    const uint32_t i0 = static_cast<uint32_t>(r) * fmt::kRowSymbols + R * lane;
    if (Full || i0 + R <= n) {
      v.r8 = *reinterpret_cast<const uint2*>(raw8 + i0);  // 8-byte aligned: blocks start at 2^10 symbols
      if constexpr (plane16) v.r16[0] = reinterpret_cast<const uint4*>(raw16 + i0)[0], v.r16[1] = reinterpret_cast<const uint4*>(raw16 + i0)[1];
    } else {
      v = Raw{};
      for (int j = 0; j < R; ++j)
        if (i0 + j < n) {
          (j < 4 ? v.r8.x : v.r8.y) |= uint32_t(raw8[i0 + j]) << (8 * (j & 3));
          if constexpr (plane16) reinterpret_cast<uint16_t*>(v.r16)[j] = raw16[i0 + j];
        }
    }
  };
  Raw cur, nxt;
  load(rows - 1, cur);
  for (int32_t r = rows - 1; r >= 0; --r) {
    if (r > 0) load(r - 1, nxt);
    // Pull the coded words of the next rows toward L1 (about 40 words a row).
    if (lane < 2 && rp > 64u * (lane + 1)) prefetch_l1(wp + rp - 64u * (lane + 1));  // inside the words
    const uint32_t i0 = static_cast<uint32_t>(r) * fmt::kRowSymbols + R * lane;
    uint32_t sym[R];
#pragma unroll
    for (int k = R - 1; k >= 0; --k) {
      sym[k] = decode_step(x, Full || i0 + k < n, lookup, encsym, wp, lt, rp, bad);
    }
    // The row's output words, off the state chain: they overlap the next row.
    uint32_t w[kWords];
    const uint32_t* r16 = reinterpret_cast<const uint32_t*>(cur.r16);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const uint32_t r8 = ((k < 4 ? cur.r8.x : cur.r8.y) >> (8 * (k & 3))) & 0xff;
      const uint32_t u = element_unit<D>(sym[k], r8, plane16 ? r16[k >> 1] >> (16 * (k & 1)) : 0u);
      if (kSymBytes<D> == 4) w[k] = u;
      else if (k & 1) w[k >> 1] |= u << 16;
      else w[k >> 1] = u;
    }
    const uint64_t e0 = first + i0;  // the lane's first symbol in the tensor
    if ((Full || chunk_in_range<D>(p.h, first, i0, n)) && vec_out) {
#pragma unroll
      for (int j = 0; j < kWords / 4; ++j)
        reinterpret_cast<uint4*>(p.out + e0 * kSymBytes<D>)[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
    } else {
      // A short last row, or an output that is not 16-byte aligned.
#pragma unroll
      for (int k = 0; k < R; ++k) {
        uint32_t u = 0;
        if (i0 + k < n) {
          const uint32_t r8 = ((k < 4 ? cur.r8.x : cur.r8.y) >> (8 * (k & 3))) & 0xff;
          u = store_element<D>(p.out, e0 + k, p.h.numel, static_cast<uint8_t>(sym[k]), static_cast<uint8_t>(r8),
                               plane16 ? static_cast<uint16_t>(r16[k >> 1] >> (16 * (k & 1))) : 0);
        }
        if (kSymBytes<D> == 4) w[k] = u;
        else if (k & 1) w[k >> 1] |= u << 16;
        else w[k >> 1] = u;
      }
    }
    const uint32_t wi = static_cast<uint32_t>(e0 * kSymBytes<D> / 4);
#pragma unroll
    for (int j = 0; j < kWords; ++j)
      if (Full || i0 + j * 4 / kSymBytes<D> < n) sum += fmt::hash_term(w[j], wi + j);
    cur = nxt;
  }
  x_io = x;
  return !bad && rp == 0;
}

// Decodes block b's symbols into p.out, adding each element's checksum term
// to this lane's sum; returns DecodeError bits (group-uniform).
template <fmt::DType D, fmt::Codec C>
PZ_DEVICE uint32_t decode_symbols(const DecompressParams& p, const fmt::Layout& l, uint64_t b, uint8_t* base,
                                  uint32_t& sum) {
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  uint32_t* encsym = reinterpret_cast<uint32_t*>(base);
  uint16_t* freq = reinterpret_cast<uint16_t*>(encsym + 256);
  uint8_t* lookup = reinterpret_cast<uint8_t*>(freq + 256);
  int32_t* shared_tb = reinterpret_cast<int32_t*>(lookup + fmt::kProbScale);

  uint64_t sb, se;
  if (!segment_bounds(p.in, h, l, b, &sb, &se)) return kErrOffsets;
  const uint8_t* seg = p.in + l.coded_begin + sb;
  const uint64_t seglen = se - sb;
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);
  const uint8_t* raw8 = p.in + l.raw_begin + first;
  const uint16_t* raw16 = reinterpret_cast<const uint16_t*>(p.in + l.plane16_begin) + first;  // 16-byte aligned plane
  const bool contig = h.version >= fmt::kContigVersion;
  if (seg[0] == fmt::kModeStored) {
    if (seglen < 1ull + n) return kErrSegment;
    for (uint32_t i0 = 0; i0 < n; i0 += fmt::kLanes) {  // group-uniform trip count: symbol_term shuffles
      const uint32_t i = i0 + lane;
      uint32_t unit = 0;
      if (i < n) unit = store_element<D>(p.out, first + i, h.numel, seg[1 + i], raw8[i], plane16 ? raw16[i] : 0);
      sum += symbol_term<D>(contig, unit, first + i, i < n);
    }
    return 0;
  }
  if constexpr (C == fmt::Codec::Fixed) {
    return seg[0] == fmt::kModeFixed ? decode_fixed<D>(p, seg, seglen, first, n, raw8, raw16, contig, sum) : kErrSegment;
  }
  if (seg[0] != fmt::kModeRans) return kErrSegment;
  group_sync();  // the previous block's tables are no longer read
  if (lane == 0) *shared_tb = rans::parse_table(seg + 1, seg + seglen, freq);
  group_sync();
  const int table_bytes = *shared_tb;
  if (table_bytes < 0) return kErrTable;
  // Cumulative frequencies (lane L owns symbols 8L..8L+7), then the
  // slot -> symbol table, every lane filling a stride of each symbol's slots.
  uint32_t f8[8], c8[8], local = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) f8[k] = freq[8 * lane + k], local += f8[k];
  uint32_t cum = group_exclusive_scan(local);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    c8[k] = cum;
    encsym[8 * lane + k] = f8[k] | (cum << 16);
    cum += f8[k];
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    for (uint32_t m = group_ballot(f8[k] != 0); m; m &= m - 1) {
      const int src = ffs32(m) - 1;
      const uint32_t c = group_shfl(c8[k], src), f = group_shfl(f8[k], src);
      for (uint32_t t = lane; t < f; t += fmt::kLanes) lookup[c + t] = static_cast<uint8_t>(8 * src + k);
    }
  }
  const uint64_t wpos = fmt::align_up(1 + table_bytes, 4);
  const uint64_t prefix = rans::rans_prefix_bytes(table_bytes);
  const uint64_t words = prefix <= seglen ? get_u32(seg + wpos) : 0;
  if (prefix > seglen || prefix + 2 * words > seglen) return kErrSegment;
  uint32_t x = get_u32(seg + wpos + 4 + 4 * lane);
  if (group_ballot(x < fmt::kStateLow)) return kErrStream;
  group_sync();  // tables complete
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(seg + prefix);  // the launcher checks 16B alignment
  // Full blocks (all but the last) drop every per-lane bounds test.
  const uint32_t wn = static_cast<uint32_t>(words);
  const bool full = full_block<D>(h, first, n);
  bool ok;
  if (contig) ok = full ? rans_rows<D, true>(p, first, n, lookup, encsym, wp, wn, raw8, raw16, x, sum)
                        : rans_rows<D, false>(p, first, n, lookup, encsym, wp, wn, raw8, raw16, x, sum);
  else ok = full ? rans_strided<D, true>(p, first, n, lookup, encsym, wp, wn, raw8, raw16, x, sum)
                 : rans_strided<D, false>(p, first, n, lookup, encsym, wp, wn, raw8, raw16, x, sum);
  if (!ok || group_ballot(x != fmt::kStateLow)) return kErrStream;
  return 0;
}

// Decodes block b into p.out and (v2) checks the elements it wrote against
// the block's checksum; returns DecodeError bits (group-uniform).
template <fmt::DType D, fmt::Codec C>
PZ_DEVICE uint32_t decode_block(const DecompressParams& p, const fmt::Layout& l, uint64_t b, uint8_t* base) {
  uint32_t sum = 0;
  const uint32_t e = decode_symbols<D, C>(p, l, b, base, sum);
  if (e || !l.nsums) return e;
  return fmt::finish_checksum(group_sum32(sum)) == get_u32(p.in + l.sums_begin + 4 * b) ? 0u : static_cast<uint32_t>(kErrChecksum);
}

// Decodes block b and ORs its errors into p.err.
template <fmt::DType D, fmt::Codec C>
PZ_DEVICE PZ_FORCE_INLINE void decode_unit(const DecompressParams& p, const fmt::Layout& l, uint64_t b, uint8_t* base) {
  const uint32_t e = decode_block<D, C>(p, l, b, base);
  if (e && group_lane() == 0) atomic_or<Scope::Device>(p.err, e);
}

// Persistent: each group strides over the blocks.
template <fmt::DType D, fmt::Codec C>
PZ_DEVICE PZ_FORCE_INLINE void decompress_blocks(const DecompressParams& p, uint64_t total) {
  extern __shared__ __align__(16) uint8_t smem[];
  fmt::Layout l = fmt::layout_of(p.h);
  l.total = total;
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  uint8_t* base = smem + group * kDecompressSmemPerGroup;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kGroupsPerCta;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + group; b < l.nblocks; b += stride)
    decode_unit<D, C>(p, l, b, base);
}

template <fmt::DType D, fmt::Codec C>
PZ_DEVICE PZ_FORCE_INLINE void decompress_kernel(DecompressParams p) {
  decompress_blocks<D, C>(p, p.h.total_bytes);
}

// The fast path of a device-parsed decode (FastDecode): only the total comes
// from the stream, every other field is the launch's.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE void fast_decode_kernel(FastDecode f) {
  const uint64_t total = *f.total;
  if (!total) return;  // grid-uniform
  decompress_blocks<D, fmt::Codec::Rans>(f.p, total);
}

// Copies bytes [a, z) of a raw payload, 16 bytes a lane where Vec, else a
// word (of 4 bytes, the last one partial) a lane.
template <bool Vec>
PZ_DEVICE PZ_FORCE_INLINE void raw_copy(const uint8_t* src, uint8_t* dst, uint64_t a, uint64_t z) {
  const int lane = group_lane();
  const uint64_t vz = Vec ? a + (z - a) / 16 * 16 : a;
  for (uint64_t i = a + 16 * lane; i < vz; i += 16 * fmt::kLanes)
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  for (uint64_t i = vz + 4 * lane; i < z; i += 4 * fmt::kLanes)
    for (uint64_t j = i; j < i + 4 && j < z; ++j) dst[j] = src[j];
}

// Raw streams, one 32-lane group per 64 KiB chunk c of the payload. Encode:
// copy the tensor's bytes into the stream and write the chunk's checksum.
// Decode: check the chunk (v2 checksum; bool: every byte 0 or 1) and only
// then copy it out, so a corrupted chunk never reaches the output. Where
// Vec, the payload and its other side are both 16-byte aligned.
template <bool Encode, bool Vec, bool Bool>
PZ_DEVICE PZ_FORCE_INLINE void raw_chunk(const uint8_t* in, uint8_t* out, uint32_t* err, const fmt::Layout& l,
                                         uint64_t c) {
  const int lane = group_lane();
  const uint64_t len = l.raw_end - l.raw_begin;
  const uint8_t* src = Encode ? in : in + l.raw_begin;
  uint8_t* dst = Encode ? out + l.raw_begin : out;
  const uint64_t a = c << fmt::kRawChunkLog2;
  const uint64_t z = len - a < (1ull << fmt::kRawChunkLog2) ? len : a + (1ull << fmt::kRawChunkLog2);
  const uint64_t vz = Vec ? a + (z - a) / 16 * 16 : a;
  uint32_t sum = 0, bad = 0;
  for (uint64_t i = a + 16 * lane; i < vz; i += 16 * fmt::kLanes) {
    const uint4 v = *reinterpret_cast<const uint4*>(src + i);
    const uint32_t k = static_cast<uint32_t>(i / 4);
    sum += fmt::hash_term(v.x, k) + fmt::hash_term(v.y, k + 1) + fmt::hash_term(v.z, k + 2) + fmt::hash_term(v.w, k + 3);
    if (Bool) bad |= (v.x | v.y | v.z | v.w) & 0xFEFEFEFEu;
    if (Encode) *reinterpret_cast<uint4*>(dst + i) = v;
  }
  for (uint64_t k = vz / 4 + lane; k < (z + 3) / 4; k += fmt::kLanes) {
    const uint32_t w = raw_word(src, k, len);
    sum += fmt::hash_term(w, static_cast<uint32_t>(k));
    if (Bool) bad |= w & 0xFEFEFEFEu;
    if (Encode)
      for (uint64_t j = 4 * k; j < 4 * k + 4 && j < z; ++j) dst[j] = src[j];
  }
  sum = fmt::finish_checksum(group_sum32(sum));
  if (Encode) {
    if (lane == 0) put_u32(out + l.sums_begin + 4 * c, sum);
    return;
  }
  uint32_t e = 0;
  if (l.nsums && sum != get_u32(in + l.sums_begin + 4 * c)) e |= kErrChecksum;
  if (Bool && group_ballot(bad != 0)) e |= kErrBool;
  if (e) {  // group-uniform
    if (lane == 0) atomic_or<Scope::Device>(err, e);
    return;
  }
  raw_copy<Vec>(src, dst, a, z);  // the chunk is in L2 from the check
}

// Raw streams: groups stride over the chunks (encode: group 0 also writes the
// header and the gap before the checksums).
template <bool Encode, bool Vec, bool Bool>
PZ_DEVICE PZ_FORCE_INLINE void raw_kernel(RawParams p) {
  const fmt::Layout l = fmt::layout_of(p.h);
  const int lane = group_lane();
  const uint64_t g0 = static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + threadIdx.x / fmt::kLanes;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kGroupsPerCta;
  if (Encode && g0 == 0) {
    for (uint64_t i = lane; i < l.raw_begin; i += fmt::kLanes) p.out[i] = p.header[i];
    for (uint64_t i = l.raw_end + lane; i < l.sums_begin; i += fmt::kLanes) p.out[i] = 0;
  }
  for (uint64_t c = g0; c < raw_chunks(l); c += stride) raw_chunk<Encode, Vec, Bool>(p.in, p.out, p.err, l, c);
}

// Decode with the header parsed on the device: the host queues it knowing
// only the output (dtype, shape), so nothing waits for the stream's header.
// Thread 0 parses each job's header into shared memory; the CTA holding the
// job's first ticket reports a bad header (kErrHeader, with the parse error)
// or one that does not describe the output (kErrMismatch), and every CTA
// then skips the job. The codec is taken from the header at run time. D is
// the job's coded dtype, or Invalid for the raw-only kernel (every dtype
// that is never coded, bool included). Coded kernels run with the rANS
// tables' shared memory.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE void device_decode_kernel(DeviceDecodeLaunch launch) {
  constexpr uint32_t kSkip = ~0u;  // head_error: a job to leave alone, without an error
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ __align__(16) uint8_t job_bytes[sizeof(DeviceDecode)];  // raw: Header is not trivially constructible
  // The parsed job, read from shared memory: a copy in registers or on the
  // stack cost the rANS loop half its occupancy (96 registers, not 64).
  __shared__ __align__(16) uint8_t params_bytes[sizeof(DecompressParams)];
  __shared__ uint32_t head_error;
  const DeviceDecode& job = *reinterpret_cast<const DeviceDecode*>(job_bytes);
  const DecompressParams& p = *reinterpret_cast<const DecompressParams*>(params_bytes);
  const fmt::Header& h = p.h;
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  uint8_t* base = smem + group * kDecompressSmemPerGroup;
  uint32_t current = ~0u;
  for (uint64_t t = blockIdx.x; t < launch.tickets; t += gridDim.x) {  // CTA-uniform
    uint32_t j = 0;
    uint64_t start = 0;
    if (launch.njobs > 1) {
      uint32_t lo = 0, hi = launch.njobs - 1;  // the first job whose end is past the ticket
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (launch.ticket_end[mid] > t) hi = mid;
        else lo = mid + 1;
      }
      j = lo;
      start = j ? launch.ticket_end[j - 1] : 0;
    }
    const uint64_t local = t - start;
    if (j != current) {
      __syncthreads();  // the previous job's header is no longer read
      if (threadIdx.x == 0) {
        DeviceDecode& w = *reinterpret_cast<DeviceDecode*>(job_bytes);
        w = launch.njobs > 1 ? launch.jobs[j] : launch.one;
        fmt::Header parsed;
        const uint64_t head = w.in_len < fmt::kMaxHeaderBytes ? w.in_len : fmt::kMaxHeaderBytes;
        const fmt::ParseError pe = fmt::parse_header(w.in, head, w.in_len, &parsed);
        uint32_t e = 0;
        if (pe != fmt::ParseError::Ok) {
          e = kErrHeader | (static_cast<uint32_t>(pe) << kParseErrorShift);
        } else {
          bool same = parsed.dtype == w.expect.dtype && parsed.ndim == w.expect.ndim;
          for (int d = 0; d < parsed.ndim; ++d) same = same && parsed.shape[d] == w.expect.shape[d];
          if (!same) e = kErrMismatch;
          // A coded kernel serves its own dtype only (the launcher's choice).
          if (D != fmt::DType::Invalid && parsed.codec != fmt::Codec::Raw && parsed.dtype != D) e = kErrMismatch;
        }
        // As expected: the FastDecode queued after this launch decodes it.
        const bool fast = w.fast_total && !e && same_plan(parsed, w.expect);
        if (w.fast_total && local == 0) *w.fast_total = fast ? parsed.total_bytes : 0;
        if (fast) e = kSkip;
        DecompressParams& q = *reinterpret_cast<DecompressParams*>(params_bytes);
        q.in = w.in, q.out = w.out, q.err = w.err, q.h = parsed;
        head_error = e;
        if (e && e != kSkip && local == 0) atomic_or<Scope::Device>(w.err, e);
      }
      current = j;
      __syncthreads();
    }
    if (head_error) continue;  // CTA-uniform
    const fmt::Layout l = fmt::layout_of(h);
    const bool raw = h.codec == fmt::Codec::Raw;
    const uint64_t work = raw ? raw_chunks(l) : l.nblocks;
    // A stream laid out otherwise than this encoder would (another block
    // size): the job's first ticket decodes all of it.
    const bool all = work != job.work;
    if (all && local != 0) continue;
    const uint64_t end = all ? work : (local + 1) * kGroupsPerCta < work ? (local + 1) * kGroupsPerCta : work;
    for (uint64_t u = (all ? 0 : local * kGroupsPerCta) + group; u < end; u += kGroupsPerCta) {  // group-uniform
      if (raw) {
        if constexpr (D == fmt::DType::Invalid) {
          const bool vec = reinterpret_cast<uintptr_t>(job.out) % 16 == 0;
          if (h.dtype == fmt::DType::Bool) {
            if (vec) raw_chunk<false, true, true>(job.in, job.out, job.err, l, u);
            else raw_chunk<false, false, true>(job.in, job.out, job.err, l, u);
          } else if (vec) {
            raw_chunk<false, true, false>(job.in, job.out, job.err, l, u);
          } else {
            raw_chunk<false, false, false>(job.in, job.out, job.err, l, u);
          }
        } else {
          // A coded dtype stored raw (not what this encoder writes for a
          // tensor with elements, but a valid stream): the plain copy, which
          // keeps the coded path's registers down.
          raw_chunk<false, false, false>(job.in, job.out, job.err, l, u);
        }
      } else if constexpr (D != fmt::DType::Invalid) {
        if (h.codec == fmt::Codec::Fixed) decode_unit<D, fmt::Codec::Fixed>(p, l, u, base);
        else decode_unit<D, fmt::Codec::Rans>(p, l, u, base);
      }
    }
  }
}

#endif

}  // namespace pz::gpu
