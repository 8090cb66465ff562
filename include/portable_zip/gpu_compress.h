// The compress kernel: one fused launch per tensor (or batch of one dtype).
// Each group splits its block, builds the block's histogram and table, and
// encodes into its shared-memory staging buffer; then a decoupled look-back
// over the blocks' sizes gives each block its final offset, and the block
// writes its segment straight there. No host sync, no global histogram, no
// coalescing pass. Shared memory per group: CompressSmem (gpu_params.h).
#pragma once
#include <stdint.h>

#include "gpu_group.h"
#include "swar.h"

namespace pz::gpu {

#if defined(PZ_CUDA) || defined(PZ_HIP)

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

// Chunk loads of one input. Aligned: 16-byte vectors. Unaligned (a view may
// start anywhere): the vectors of the 16-byte-aligned span around the chunk
// (one more than the chunk), shifted by the input's misalignment: the
// aligned kernel's loop at 2 loads a chunk instead of 8-16 byte loads. Every
// byte read lies inside the tensor, so the tensor's first chunk and its last
// few are split element by element instead (vec() is false for them; pass 1
// splits the whole first row).
template <fmt::DType D, bool Aligned>
struct ChunkLoader {
  static constexpr uint32_t kVecs = kSymBytes<D> / 2;  // a chunk's 16-byte vectors
  const CompressParams& p;  // (aligned: nothing else, so the input stays a launch parameter)
  uint32_t shift = 0;       // unaligned: the input's misalignment
  uint64_t last = 0;        // unaligned: the last chunk offset (bytes) whose span ends inside the tensor

  PZ_DEVICE PZ_FORCE_INLINE explicit ChunkLoader(const CompressParams& q) : p(q) {
    if constexpr (!Aligned) {
      shift = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p.in) & 15);
      const uint64_t len = p.h.numel * static_cast<uint64_t>(fmt::elem_size(D));
      const uint64_t span = 16 * (kVecs + 1) - shift;  // bytes read past a chunk's start
      last = len >= span ? len - span : 0;
    }
  }
  // Whether the chunk of symbols [sym, sym + 8) may be loaded as vectors
  // (the caller has checked that its symbols are in the tensor).
  PZ_DEVICE PZ_FORCE_INLINE bool vec(uint64_t sym) const {
    if constexpr (Aligned) return true;
    const uint64_t o = sym * kSymBytes<D>;
    return o >= 16 && o <= last;
  }
  PZ_DEVICE PZ_FORCE_INLINE RawChunk<D> load(uint64_t sym) const {
    if constexpr (Aligned) {
      return load_raw<D>(p.in, sym);
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(p.in - shift + sym * kSymBytes<D>);
      uint32_t w[4 * (kVecs + 1)];
#pragma unroll
      for (uint32_t k = 0; k <= kVecs; ++k) {
        const uint4 v = src[k];
        w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
      }
      // Whole words first (by 1, then 2: constant indices, no local memory), then bytes.
      const uint32_t q = shift >> 2, r = 8 * (shift & 3);
#pragma unroll
      for (uint32_t j = 0; j + 1 < 4 * (kVecs + 1); ++j) w[j] = q & 1 ? w[j + 1] : w[j];
#pragma unroll
      for (uint32_t j = 0; j + 2 < 4 * (kVecs + 1); ++j) w[j] = q & 2 ? w[j + 2] : w[j];
      RawChunk<D> out;
      uint32_t o[4 * kVecs];
#pragma unroll
      for (uint32_t j = 0; j < 4 * kVecs; ++j)
        o[j] = static_cast<uint32_t>(((static_cast<uint64_t>(w[j + 1]) << 32) | w[j]) >> r);
#pragma unroll
      for (uint32_t k = 0; k < kVecs; ++k) out.v[k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
      return out;
    }
  }
};

// The split of a loaded chunk (FloatTraits::split, for every coded dtype),
// a word at a time: swar.h.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE Chunk<D> split_chunk(const RawChunk<D>& r) {
  uint32_t w[2 * kSymBytes<D>];
#pragma unroll
  for (int k = 0; k < kSymBytes<D> / 2; ++k) {
    w[4 * k] = r.v[k].x;
    w[4 * k + 1] = r.v[k].y;
    w[4 * k + 2] = r.v[k].z;
    w[4 * k + 3] = r.v[k].w;
  }
  Chunk<D> c{};
  split_words<D>(w, c.sym, c.raw8, c.raw16);
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

// Calls f(Flag<true>{}) for a full block (no bounds tests in its loops), else
// f(Flag<false>{}).
template <fmt::DType D, class F>
PZ_DEVICE PZ_FORCE_INLINE void by_fullness(const fmt::Header& h, uint64_t first, uint32_t n, F&& f) {
  if (full_block<D>(h, first, n)) f(Flag<true>{});
  else f(Flag<false>{});
}

// Pass 2 driver: calls f(idx, sym, valid, s) for the block's symbols step by
// step, 8 steps per row, from row_begin (a multiple of the row), and
// row_done() after each row, stopping when it returns true (group-uniform).
// Returns the symbol where it stopped (>= n when the block is done). Contig
// (v3 rANS rows, S states a lane: 32 * S format lanes): a row is 256 * S
// symbols, lane L's state s codes symbol row + 256 s + 8L + k at step k,
// straight from its registers, states in order within a step (the format's
// lane order). Otherwise (v1/v2 layout, the fixed code; S = 1) a 256-symbol
// row's chunks are redistributed with shuffles so lane L gets symbol row +
// 32k + L. A lane loads one 8-symbol chunk per state per row; the next rows'
// chunks (two rows of one state, one row of two) are in flight while a row is
// coded. Steps have no branches (a full block has no bounds tests at all), so
// the compiler can overlap one step's symbol fetch with the previous step's
// state update, and the states' chains with each other.
template <fmt::DType D, bool Aligned, bool Full, bool Contig, int S, class F, class R>
PZ_DEVICE PZ_FORCE_INLINE uint32_t for_each_step(const CompressParams& p, uint64_t first, uint32_t n, uint32_t row_begin, F&& f,
                                                 R&& row_done) {
  using T = FloatTraits<D>;
  static_assert(Contig || S == 1, "strided rows have one state");
  static_assert(kChunkSyms == fmt::kLaneRun, "a v3 lane's run is one chunk");
  constexpr int kAhead = S == 1 ? 2 : 1;                    // rows in flight
  constexpr uint32_t kHalf = fmt::kLanes * kChunkSyms;      // one state's part of a row
  constexpr uint32_t kRow = kHalf * S;
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  const ChunkLoader<D, Aligned> ld(p);
  auto in_range = [&](uint32_t i) {
    return (Full ? i + kChunkSyms <= n : chunk_in_range<D>(h, first, i, n)) && ld.vec(first + i);
  };
  RawChunk<D> ahead[kAhead][S] = {};
  auto load_row = [&](uint32_t row, RawChunk<D>* dst) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const uint32_t i = row + s * kHalf + lane * kChunkSyms;
      if (in_range(i)) dst[s] = ld.load(first + i);
    }
  };
#pragma unroll
  for (int a = 0; a < kAhead; ++a) load_row(row_begin + a * kRow, ahead[a]);
  uint32_t row = row_begin;
  for (; row < n; row += kRow) {
    RawChunk<D> cur[S];
#pragma unroll
    for (int s = 0; s < S; ++s) cur[s] = ahead[0][s];
#pragma unroll
    for (int a = 0; a + 1 < kAhead; ++a)
#pragma unroll
      for (int s = 0; s < S; ++s) ahead[a][s] = ahead[a + 1][s];
    load_row(row + kAhead * kRow, ahead[kAhead - 1]);
    uint32_t lo[S], hi[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const uint32_t mine = row + s * kHalf + lane * kChunkSyms;
      lo[s] = hi[s] = 0;
      if (in_range(mine)) {
        const Chunk<D> c = split_chunk<D>(cur[s]);
        lo[s] = c.sym[0];
        hi[s] = c.sym[1];
      } else {
        for (int k = 0; k < kChunkSyms; ++k)
          if (mine + k < n) {
            const uint32_t sy = T::split(p.in, first + mine + k, h.numel).sym;
            (k < 4 ? lo[s] : hi[s]) |= sy << (8 * (k & 3));
          }
      }
    }
#pragma unroll
    for (int k = 0; k < kChunkSyms; ++k) {
      if constexpr (Contig) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const uint32_t idx = row + s * kHalf + lane * kChunkSyms + k;
          f(idx, ((k < 4 ? lo[s] : hi[s]) >> (8 * (k & 3))) & 0xff, Full || idx < n, s);
        }
      } else {
        const uint32_t idx = row + k * fmt::kLanes + lane;
        f(idx, row_byte(lo[0], hi[0], k), Full || idx < n, 0);
      }
    }
    if (row_done()) return row + kRow;
  }
  return row;
}

// Where a block's segment is at look-back time. Staged: all of it is in the
// staging buffer. Stored: nothing is (the symbols are split again at copy-out).
// Overflow: rANS, its first staging-buffer bytes are staged and the rest is in the
// group's spill slot; the fixed code, the prefix is staged and the body is
// encoded into the output.
enum SegmentKind : uint32_t { kStaged = 0, kStoredLate = 1, kOverflow = 2 };
struct Segment {
  uint32_t used;  // bytes before padding
  uint32_t kind;
};

// The rANS encode loop, S states a lane (the header's lanes / 32): words go
// to wbuf while below cap, then to spill (a word count past the block's
// limit makes it stored). Rows run without the spill test while a whole
// row's words (at most one a symbol) fit below cap. Returns the final states
// (x_out[s]: format lane 32 s + this lane) and the total word count; *stored
// tells whether the words reached the limit.
template <fmt::DType D, bool Aligned, int S>
PZ_DEVICE PZ_FORCE_INLINE void rans_loop(const CompressParams& p, uint64_t first, uint32_t n, const uint2* enc,
                                         uint16_t* wbuf, uint32_t cap, uint16_t* spill, uint32_t prefix, uint32_t limit,
                                         uint32_t* x_out, uint32_t* words_out, bool* stored) {
  const uint32_t lt = group_lanemask_lt();
  uint32_t x[S], words = 0;
#pragma unroll
  for (int s = 0; s < S; ++s) x[s] = fmt::kStateLow;
  auto step = [&](uint32_t sym, bool valid, int s, auto spilling) {
    const uint2 e = enc[sym];  // rans::enc_entry
    const bool need = valid && rans::enc_entry_renorm(x[s], e.x);
    const uint32_t ballot = group_ballot(need);
    const uint32_t pos = words + popc32(ballot & lt);
    if constexpr (decltype(spilling)::value) {
      if (need && pos < cap) wbuf[pos] = static_cast<uint16_t>(x[s]);
      if (need && pos >= cap) spill[pos - cap] = static_cast<uint16_t>(x[s]);
    } else {
      if (need) wbuf[pos] = static_cast<uint16_t>(x[s]);
    }
    const uint32_t xr = need ? x[s] >> 16 : x[s];
    words += popc32(ballot);
    const uint32_t y = rans::enc_entry_put(xr, e.x, e.y);
    x[s] = valid ? y : xr;
  };
  auto staged = [&](uint32_t, uint32_t sym, bool valid, int s) { step(sym, valid, s, Flag<false>{}); };
  auto spilled = [&](uint32_t, uint32_t sym, bool valid, int s) { step(sym, valid, s, Flag<true>{}); };
  auto row_done = [&] { return *stored = prefix + 2 * words >= limit; };
  auto row_fits = [&] { return row_done() || words + S * fmt::kRowSymbols > cap; };
  by_fullness<D>(p.h, first, n, [&](auto full) {
    constexpr bool Full = decltype(full)::value;
    const uint32_t row = for_each_step<D, Aligned, Full, true, S>(p, first, n, 0, staged, row_fits);
    if (!*stored && row < n) for_each_step<D, Aligned, Full, true, S>(p, first, n, row, spilled, row_done);
  });
#pragma unroll
  for (int s = 0; s < S; ++s) x_out[s] = x[s];
  *words_out = words;
}

// rANS body of a block: table and encode table, then the encode into the
// staging buffer and, past it, the spill slot.
template <fmt::DType D, bool Aligned, int S, uint32_t kStage>
PZ_DEVICE Segment encode_rans(const CompressParams& p, uint64_t first, uint32_t n, const uint32_t* counts, uint2* enc,
                              uint16_t* freq, uint8_t* buf, uint8_t* spill) {
  const int lane = group_lane();
  quantize_group(counts, n, freq);
  const int table_bytes = write_table_group(freq, buf + 1);
  // Cumulative frequencies: lane L owns symbols 8L..8L+7.
  uint32_t f8[8], local = 0;
  for (int k = 0; k < 8; ++k) f8[k] = freq[8 * lane + k], local += f8[k];
  uint32_t cum = group_exclusive_scan(local);
  for (int k = 0; k < 8; ++k) {
    const rans::EncEntry e = rans::enc_entry(f8[k], cum, rans::div_magic(f8[k]));
    enc[8 * lane + k] = make_uint2(e.w, e.magic);
    cum += f8[k];
  }
  group_sync();
  // 32-bit bookkeeping: a segment is at most 1 + 2^15 bytes.
  const uint32_t prefix = rans::rans_prefix_bytes(table_bytes, S * fmt::kLanes);
  const uint32_t limit = 1u + n;
  if (prefix >= limit) return {0, kStoredLate};
  static_assert(fmt::align_up(1 + kMaxTableBytes, 4) + 4 + 4 * fmt::kWideLanes + 2 * fmt::kMaxRowSymbols <= kStage &&
                    kStage % 16 == 0 && kStage >= kStagingBytes,
                "the prefix and a row's words are staged, the staged words fill the buffer exactly, and the "
                "spill slot holds the rest");
  const uint32_t room = (kStage - prefix) / 2;  // the prefix is a multiple of 4
  uint32_t x[S], words;
  bool stored = false;
  rans_loop<D, Aligned, S>(p, first, n, enc, reinterpret_cast<uint16_t*>(buf + prefix), room,
                           reinterpret_cast<uint16_t*>(spill), prefix, limit, x, &words, &stored);
  if (stored) return {0, kStoredLate};
  const uint32_t wpos = static_cast<uint32_t>(fmt::align_up(1 + table_bytes, 4));
  if (lane == 0) {
    buf[0] = fmt::kModeRans;
    for (uint32_t i = 1 + table_bytes; i < wpos; ++i) buf[i] = 0;
    put_u32(buf + wpos, words);
  }
#pragma unroll
  for (int s = 0; s < S; ++s) reinterpret_cast<uint32_t*>(buf + wpos + 4)[fmt::kLanes * s + lane] = x[s];
  const uint32_t used = prefix + 2 * words;  // < limit
  return {used, used <= kStage ? kStaged : kOverflow};
}

// The fixed code's bit planes and escapes of one block, written to planes/esc.
template <fmt::DType D, bool Aligned>
PZ_DEVICE PZ_FORCE_INLINE void fixed_loop(const CompressParams& p, uint64_t first, uint32_t n, const uint8_t* code,
                                          uint32_t* planes, uint8_t* esc) {
  const int lane = group_lane();
  const uint32_t lt = group_lanemask_lt();
  uint32_t e = 0;
  auto step = [&](uint32_t idx, uint32_t sym, bool valid, int) {
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
  by_fullness<D>(p.h, first, n, [&](auto full) {
    for_each_step<D, Aligned, decltype(full)::value, false, 1>(p, first, n, 0, step, never);
  });
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
  if (size >= 1ull + n) return {0, kStoredLate};
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
  if (size > kStagingBytes) return {static_cast<uint32_t>(size), kOverflow};
  fixed_loop<D, Aligned>(p, first, n, code, reinterpret_cast<uint32_t*>(buf + fmt::kFixedPrefixBytes),
                         buf + fmt::kFixedPrefixBytes + fmt::fixed_planes_bytes(n));
  return {static_cast<uint32_t>(size), kStaged};
}

// Encodes block b into the group's staging buffer (split, histogram, table,
// coded body) and writes its raw planes. Returns where its segment is. S:
// rANS states a lane (format lanes / 32), 0 to take it from the header.
template <fmt::DType D, bool Aligned, fmt::Codec C, int S, class Smem>
PZ_DEVICE Segment encode_block(const CompressParams& p, const fmt::Layout& l, uint64_t b, Smem& s, uint8_t* spill) {
  using T = FloatTraits<D>;
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  uint2* enc = reinterpret_cast<uint2*>(s.enc);
  uint16_t* freq = s.freq;
  uint8_t* buf = s.staging;
  uint32_t* hist = s.hist;
  uint32_t* counts = s.counts;
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);

  // Pass 1: split, histogram, raw planes. Two lanes see at most 2^15 / 16
  // symbols of a block, so two 16-bit counters share a word.
  group_sync();  // the previous block's segment has left the staging buffer
  for (uint32_t i = lane; i < kHistBytes / 16; i += fmt::kLanes) reinterpret_cast<uint4*>(hist)[i] = make_uint4(0, 0, 0, 0);
  group_sync();
  auto count = [&](uint32_t sym) {
    atomic_add<Scope::Block>(&hist[(sym >> 1) * kHistReplicas + (lane & (kHistReplicas - 1))], 1u << (16 * (sym & 1)));
  };
  uint32_t sum = 0;  // this lane's share of the block checksum (v3: words)
  // Symbols [from, to) of the block element by element, and their words.
  auto scalar = [&](uint32_t from, uint32_t to) {
    for (uint32_t i = from + lane; i < to; i += fmt::kLanes) {
      const Split sp = T::split(p.in, first + i, h.numel);
      count(sp.sym);
      write_raw(p.out, l, plane16, first + i, sp);
    }
    uint64_t lo, hi, len;
    block_words(h, first + from, to - from, &lo, &hi, &len);
    for (uint64_t k = lo + lane; k < hi; k += fmt::kLanes) sum += fmt::hash_term(raw_word(p.in, k, len), static_cast<uint32_t>(k));
  };
  // Rows of vectors, software-pipelined: the next two rows are in flight
  // while two are consumed. An unaligned input's first row, the rows near its
  // end whose vectors would pass it (ChunkLoader), and every block's short
  // tail go element by element.
  constexpr uint32_t kRow = fmt::kLanes * kChunkSyms;
  const ChunkLoader<D, Aligned> ld(p);
  const uint32_t head = !Aligned && first == 0 ? (n < kRow ? n : kRow) : 0;
  auto row_full = [&](uint32_t row) {
    const uint32_t end = row + (fmt::kLanes - 1) * kChunkSyms;  // the row's last chunk
    return chunk_in_range<D>(h, first, end, n) && ld.vec(first + row) && ld.vec(first + end);
  };
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
  uint32_t row = head;
  bool fa = row_full(row), fb = fa && row_full(row + kRow);
  RawChunk<D> a{}, bb{};
  if (fa) a = ld.load(first + row + mine);
  if (fb) bb = ld.load(first + row + kRow + mine);
  while (fb) {
    const uint32_t next = row + 2 * kRow;
    const bool na = row_full(next), nb = na && row_full(next + kRow);
    RawChunk<D> c{}, d{};
    if (na) c = ld.load(first + next + mine);
    if (nb) d = ld.load(first + next + kRow + mine);
    consume(row + mine, a);
    consume(row + kRow + mine, bb);
    a = c, bb = d, row = next, fa = na, fb = nb;
  }
  if (fa) {
    consume(row + mine, a);
    row += kRow;
  }
  if (head) scalar(0, head);
  if (row < n) scalar(row, n);  // (row == head == n: a word of its symbols is not after it)
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
  else if constexpr (S == 0)
    seg = h.lanes == fmt::kWideLanes ? encode_rans<D, Aligned, 2, Smem::kStaging>(p, first, n, counts, enc, freq, buf, spill)
                                     : encode_rans<D, Aligned, 1, Smem::kStaging>(p, first, n, counts, enc, freq, buf, spill);
  else seg = encode_rans<D, Aligned, S, Smem::kStaging>(p, first, n, counts, enc, freq, buf, spill);
  group_sync();
  if (seg.kind == kStaged)  // zero padding, copied out with the segment
    for (uint32_t i = seg.used + lane; i < fmt::align_up(seg.used, fmt::kAlign); i += fmt::kLanes) buf[i] = 0;
  group_sync();
  return seg;
}

// Writes block b's segment at dst (16-byte aligned): from the staging buffer
// (and the spill slot), or split again (stored), or the staged prefix plus an
// encode of the fixed-code body. Zero padding to `padded`.
template <fmt::DType D, bool Aligned, fmt::Codec C, class Smem>
PZ_DEVICE void write_segment(const CompressParams& p, const fmt::Layout& l, uint64_t b, const Smem& s, Segment seg,
                             uint64_t padded, uint8_t* dst, const uint8_t* spill) {
  using T = FloatTraits<D>;
  const int lane = group_lane();
  const uint8_t* code = s.code;
  const uint8_t* buf = s.staging;
  const uint64_t first = b << p.h.block_log2;
  const uint32_t n = fmt::block_symbols(p.h, l, b);
  uint32_t used = seg.used;
  if (seg.kind == kStaged || (C == fmt::Codec::Rans && seg.kind == kOverflow)) {
    const uint32_t staged = seg.kind == kStaged ? static_cast<uint32_t>(padded) : Smem::kStaging;
    for (uint32_t i = lane; i < staged / 16; i += fmt::kLanes)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(buf)[i];
    // The spilled words, their last vector's bytes past `used` zeroed.
    const uint32_t spilled = static_cast<uint32_t>(padded) - staged;
    for (uint32_t i = lane; i < spilled / 16; i += fmt::kLanes) {
      uint4 v = reinterpret_cast<const uint4*>(spill)[i];
      const int32_t left = static_cast<int32_t>(used - staged - 16 * i);  // >= 1
      auto keep = [](uint32_t w, int32_t bytes) { return bytes >= 4 ? w : bytes <= 0 ? 0u : w & ((1u << (8 * bytes)) - 1); };
      v = make_uint4(keep(v.x, left), keep(v.y, left - 4), keep(v.z, left - 8), keep(v.w, left - 12));
      reinterpret_cast<uint4*>(dst + staged)[i] = v;
    }
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
  }
  for (uint64_t i = used + lane; i < padded; i += fmt::kLanes) dst[i] = 0;
}

// One ticket of one tensor: encode its blocks, look back, write the segments.
template <fmt::DType D, bool Aligned, fmt::Codec C, int S>
PZ_DEVICE PZ_FORCE_INLINE void compress_ticket(const CompressParams& p, uint64_t ticket, uint8_t* smem, uint8_t* spill,
                                               uint64_t* cta_size, uint64_t* cta_excl) {
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const fmt::Layout l = fmt::layout_of(h);
  const int lane = group_lane();
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  using Smem = CompressSmem<compress_staging(S)>;
  Smem& s = reinterpret_cast<Smem*>(smem)[group];
    const uint64_t b = ticket * kGroupsPerCta + group;
    const bool active = b < l.nblocks;
    Segment seg{0, kStaged};
    if (active) seg = encode_block<D, Aligned, C, S, Smem>(p, l, b, s, spill);
    const uint64_t padded = !active ? 0
                            : seg.kind == kStoredLate ? fmt::max_segment_bytes(fmt::block_symbols(h, l, b))
                                                      : fmt::align_up(seg.used, fmt::kAlign);
    if (lane == 0) cta_size[group] = padded;
    PZ_BLOCK_SYNC();
    if (group == 0) {
      uint64_t agg = 0;
      for (int g = 0; g < kGroupsPerCta; ++g) agg += cta_size[g];
      const uint64_t excl = lookback(p.status, ticket, agg);
      if (lane == 0) *cta_excl = excl;
    }
    PZ_BLOCK_SYNC();
    if (active) {
      uint64_t excl = *cta_excl;
      for (int g = 0; g < group; ++g) excl += cta_size[g];
      write_segment<D, Aligned, C, Smem>(p, l, b, s, seg, padded, p.out + l.coded_begin + excl, spill);
      if (lane == 0) *reinterpret_cast<uint64_t*>(p.out + l.offsets_begin + 8 * b) = excl + padded;
      if (b == 0) {
        // Header (minus the total, which the last block owns) and the zero gaps.
        // (The last block owns the total and the header checksum.)
        for (uint64_t i = lane; i < l.raw_begin; i += fmt::kLanes)
          if (i < fmt::kTotalBytesOffset || (i >= fmt::kTotalBytesEnd && i < fmt::kHeaderSumOffset) ||
              i >= fmt::kHeaderSumOffset + 4)
            p.out[i] = p.header[i];
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
          fmt::put_u64(p.out + fmt::kTotalBytesOffset, total);
          put_u32(p.out + fmt::kHeaderSumOffset, h.version >= 2 ? hsum : 0u);
        }
      }
    }
}

// A persistent CTA takes tickets until the blocks run out. Single tensor:
// ticket t encodes blocks t*kGroupsPerCta + group, its parameters read from
// the launch itself. Batched: the ticket first picks its tensor, whose
// parameters are staged in shared memory. S: rANS states a lane, fixed by the
// aligned single-tensor kernels' instantiation, taken from each tensor's
// header in a batch or an unaligned tensor's kernel (S = 0: both coders in one
// kernel, so one launch serves tensors of any size; gpu_params.h,
// compress_states). Tickets are handed out in order,
// so every look-back waits only on CTAs already running. The look-back runs
// per CTA, by group 0 only: on wave64 both groups share one wave, so no group
// may spin on a result its wave-mate has yet to produce. (The wave64
// emulation holds group 1 at the CTA barrier meanwhile, standing in for its
// masked-off lanes: intrinsics.h.)
template <fmt::DType D, bool Aligned, fmt::Codec C, bool Batched, int S>
PZ_DEVICE PZ_FORCE_INLINE void compress_kernel(CompressLaunch launch) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t cta_ticket;
  __shared__ uint64_t cta_size[kGroupsPerCta];
  __shared__ uint64_t cta_excl;
  // This group's spill slot (rANS): the launcher gives each CTA of the grid its slots.
  uint8_t* spill = C != fmt::Codec::Rans ? nullptr
                  : launch.spill + (static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + threadIdx.x / fmt::kLanes) * kSpillBytes;
  if constexpr (!Batched) {
    const uint64_t tickets = (fmt::layout_of(launch.one.h).nblocks + kGroupsPerCta - 1) / kGroupsPerCta;
    for (;;) {
      if (threadIdx.x == 0) cta_ticket = atomic_add<Scope::Device>(launch.ticket, 1u);
      PZ_BLOCK_SYNC();
      const uint64_t ticket = cta_ticket;
      if (ticket >= tickets) return;  // CTA-uniform
      compress_ticket<D, Aligned, C, S>(launch.one, ticket, smem, spill, cta_size, &cta_excl);
      PZ_BLOCK_SYNC();  // cta_ticket, cta_size and the staging buffers are reused
    }
  } else {
    __shared__ __align__(16) uint8_t job_bytes[sizeof(CompressParams)];  // raw: Header is not trivially constructible
    CompressParams& job = *reinterpret_cast<CompressParams*>(job_bytes);
    const uint64_t total = launch.ticket_end[launch.njobs - 1];
    uint32_t current = ~0u;
    for (;;) {
      if (threadIdx.x == 0) cta_ticket = atomic_add<Scope::Device>(launch.ticket, 1u);
      PZ_BLOCK_SYNC();
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
        PZ_BLOCK_SYNC();
      }
      compress_ticket<D, Aligned, C, S>(job, ticket, smem, spill, cta_size, &cta_excl);
      PZ_BLOCK_SYNC();  // cta_ticket, cta_size, job and the staging buffers are reused
    }
  }
}

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz::gpu
