// The decompress kernels: host-parsed (one stream whose header the host
// read), device-parsed (the header parsed on the device: no host sync; a
// general kernel for any stream, and a fast kernel for the stream this
// encoder writes), and their per-block rANS and fixed-code decoders. Shared
// memory per group: DecompressSmem (gpu_params.h).
#pragma once
#include <stdint.h>

#include "gpu_group.h"
#include "gpu_raw.h"
#include "swar.h"

namespace pz::gpu {

#if defined(PZ_CUDA) || defined(PZ_HIP)

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

// A v3 row's output words from a lane's 8 symbols and raw bits (the inverse
// of split_chunk): swar.h.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE void join_row(const uint32_t* sym, uint2 r8, const uint32_t* r16, uint32_t* w) {
  join_words<D>(sym, r8.x, r8.y, r16, w);
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
// Checked: as above. Unchecked (rans_rows says when: no step of the row can
// run out of words or read word rp): no underflow test, no branch. mask:
// word i is wp[i & mask] (a ring of the words in shared memory), else ~0.
template <bool Checked = true>
PZ_DEVICE PZ_FORCE_INLINE uint32_t decode_step(uint32_t& x, bool valid, const uint8_t* lookup, const uint32_t* encsym,
                                               const uint16_t* wp, uint32_t lt, uint32_t& rp, bool& bad,
                                               uint32_t mask = ~0u) {
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
  if constexpr (!Checked) {
    // Every lane loads (no branch): lanes that need no word read word
    // rp - count, inside the words since the row started below the last
    // word (rp < words) with rp >= 256 >= count.
    const uint32_t word = wp[(rp - count + (need ? popc32(ballot & lt) : 0u)) & mask];
    x = need ? (x << 16) | word : x;
    rp -= count;
    return sym;
  }
  const bool under = count > rp;  // group-uniform
  bad |= under;
  // Out of words (a corrupt stream): no read at all (wp may end the stream).
  if (need && !under) x = (x << 16) | wp[(rp - count + popc32(ballot & lt)) & mask];
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

// The coded words of a 32-lane block staged in a ring of kWordRing words
// in shared memory (word i at ring[i % kWordRing]), so a step's word is a
// shared load, not a global one on its chain. Words are read from the last
// down: at each row the ring holds every word a row can take (at most 192
// below the read position: gpu_params.h, kWordRing) and the loads of the next row's are in flight
// (word pairs, up to 4 a lane, kept in registers and stored a row later):
// the ring holds [lo, rp) with lo at most kWordRing below rp, so a store
// only ever replaces a word already read. The words are 4-byte aligned (a
// segment starts 16-byte aligned and the prefix is whole 32-bit words), so
// pairs are 32-bit loads; an odd last word is loaded alone. Every load lies
// inside the words, whatever the stream holds.
struct WordRing {
  static constexpr int kPairs = 4;  // pairs a lane a row: a row takes <= 192 words, 100 pairs with alignment
  uint32_t v[kPairs];
  uint32_t lo = 0, top = 0;         // words [lo, top) were last asked for (lo even)
  // Loads the last words of the block, [lo, words), into the ring.
  PZ_DEVICE PZ_FORCE_INLINE void start(uint16_t* ring, const uint16_t* wp, uint32_t words) {
    const int lane = group_lane();
    lo = top = words > kWordRing ? static_cast<uint32_t>(fmt::align_up(words - kWordRing, 8)) : 0u;
    const uint32_t* wp32 = reinterpret_cast<const uint32_t*>(wp);
    uint32_t* ring32 = reinterpret_cast<uint32_t*>(ring);
    for (uint32_t m = lo / 2 + lane; 2 * m + 1 < words; m += fmt::kLanes) ring32[m % (kWordRing / 2)] = wp32[m];
    if ((words & 1) && lane == 0) ring[(words - 1) % kWordRing] = wp[words - 1];
    group_sync();
  }
  // At a row's start (read position rp): stores the pairs asked for a row
  // ago, then asks for those down to kWordRing below rp.
  PZ_DEVICE PZ_FORCE_INLINE void next_row(uint16_t* ring, const uint16_t* wp, uint32_t rp) {
    const int lane = group_lane();
    uint32_t* ring32 = reinterpret_cast<uint32_t*>(ring);
#pragma unroll
    for (int t = 0; t < kPairs; ++t) {
      const uint32_t m = top / 2 - 1 - (fmt::kLanes * t + lane);  // wraps below 0: then not < top / 2
      if (m >= lo / 2 && m < top / 2) ring32[m % (kWordRing / 2)] = v[t];
    }
    group_sync();
    uint32_t want = rp > kWordRing ? static_cast<uint32_t>(fmt::align_up(rp - kWordRing, 8)) : 0u;
    const uint32_t floor = lo > 2 * fmt::kLanes * kPairs ? lo - 2 * fmt::kLanes * kPairs : 0u;  // registers' bound
    if (want < floor) want = floor;
    if (want > lo) want = lo;
    top = lo, lo = want;
    const uint32_t* wp32 = reinterpret_cast<const uint32_t*>(wp);
#pragma unroll
    for (int t = 0; t < kPairs; ++t) {
      const uint32_t m = top / 2 - 1 - (fmt::kLanes * t + lane);
      v[t] = m >= lo / 2 && m < top / 2 ? wp32[m] : 0u;
    }
  }
};

// The v3 rANS decode loop of one block, S states a lane (format lanes =
// 32 S): lane L's state s decodes symbols row + 256 s + 8L + 7 down to row +
// 256 s + 8L of each row of 256 S symbols, last row first, the states of a
// step in reverse order (format lanes 32 S - 1 .. 0), into registers, then
// writes its 8 elements per state with one or two 16-byte stores and hashes
// their words for the checksum. The states' chains are independent: only the
// read position passes from one to the next. The raw bits of the next row
// (one 8-byte load per state, fp32 two more 16-byte loads) are in flight
// while a row decodes. A word-count underflow (corrupt stream) is recorded
// and the read position clamped, so reads stay inside the segment without a
// branch. Returns false when the words do not add up. Ring (S == 1 only):
// the steps read the words from ring, the group's kWordRing words of shared
// memory (WordRing).
template <fmt::DType D, bool Full, int S, bool Ring>
PZ_DEVICE PZ_FORCE_INLINE bool rans_rows(const DecompressParams& p, uint64_t first, uint32_t n, const uint8_t* lookup,
                                         const uint32_t* encsym, const uint16_t* wp, uint32_t words,
                                         const uint8_t* raw8, const uint16_t* raw16, uint32_t* x_io, uint32_t& sum,
                                         uint16_t* ring) {
  constexpr bool plane16 = fmt::has_plane16(D);
  constexpr int R = fmt::kLaneRun;
  constexpr int kWords = R * kSymBytes<D> / 4;  // output words per lane per state per row
  constexpr uint32_t kHalf = fmt::kRowSymbols;  // one state's part of a row
  constexpr uint32_t kRow = kHalf * S;
  const int lane = group_lane();
  const uint32_t lt = group_lanemask_lt();
  const int32_t rows = static_cast<int32_t>((n + kRow - 1) / kRow);
  const bool vec_out = (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;  // group-uniform
  uint32_t x[S], rp = words;
#pragma unroll
  for (int s = 0; s < S; ++s) x[s] = x_io[s];
  bool bad = false;
  struct Raw {
    uint2 r8;
    uint4 r16[plane16 ? 2 : 1];
  };
  auto load = [&](int32_t r, int s, Raw& v) {
    const uint32_t i0 = static_cast<uint32_t>(r) * kRow + s * kHalf + R * lane;
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
  Raw cur[S], nxt[S];
  uint32_t touched = 0;  // the last row's word-line load
  static_assert(!Ring || S == 1, "the ring holds one state's words a lane");
  WordRing wr;
  if constexpr (Ring) wr.start(ring, wp, words);
  const uint16_t* rd = Ring ? ring : wp;  // where the steps read word i: rd[i & mask]
  constexpr uint32_t mask = Ring ? kWordRing - 1 : ~0u;
#pragma unroll
  for (int s = 0; s < S; ++s) load(rows - 1, s, cur[s]);
  for (int32_t r = rows - 1; r >= 0; --r) {
    if (r > 0)
#pragma unroll
      for (int s = 0; s < S; ++s) load(r - 1, s, nxt[s]);
    if constexpr (Ring) wr.next_row(ring, wp, rp);  // this row's words in place, the next row's on their way
    // Pull the coded words of the next rows toward L1 (about 40 words per state a row).
    // 32 lanes: with loads, not the prefetch hint, which left most word loads missing
    // L1 (bench/NOTES.md, s21). Each load's value is consumed a row later, when it has
    // long arrived, by a test that cannot hold (rp <= words), so the load stays and
    // nothing waits on it. 64 lanes keep the hint: their registers are capped, and the
    // loads measured slower there.
    if constexpr (S == 1) {
      if constexpr (!Ring) {
        bad |= touched == 0x9e3779b9u && rp > words;
        touched = lane < 2 && rp > 64u * (lane + 1) ? touch_l1(wp + ((rp - 64u * (lane + 1)) & ~1u)) : 0u;  // inside the words
      }
    } else if (lane < 2 * S && rp > 64u * (lane + 1)) {
      prefetch_l1(wp + rp - 64u * (lane + 1));  // inside the words
    }
    uint32_t sym[S][R];
    // Unchecked rows (group-uniform): a row takes at most one word per symbol,
    // so rp >= kRow keeps every read inside the words; rp < words keeps the
    // word read by lanes that need none (word rp - count, rp when none of
    // the group needs one) off the stream's end, which word `words` may be.
    if (Full && rp >= kRow && rp < words) {
#pragma unroll
      for (int k = R - 1; k >= 0; --k)
#pragma unroll
        for (int s = S - 1; s >= 0; --s) sym[s][k] = decode_step<false>(x[s], true, lookup, encsym, rd, lt, rp, bad, mask);
    } else {
#pragma unroll
      for (int k = R - 1; k >= 0; --k)
#pragma unroll
        for (int s = S - 1; s >= 0; --s) {
          const uint32_t i0 = static_cast<uint32_t>(r) * kRow + s * kHalf + R * lane;
          sym[s][k] = decode_step(x[s], Full || i0 + k < n, lookup, encsym, rd, lt, rp, bad, mask);
        }
    }
    // The row's output words, off the state chains: they overlap the next row.
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const uint32_t i0 = static_cast<uint32_t>(r) * kRow + s * kHalf + R * lane;
      uint32_t w[kWords];
      const uint32_t* r16 = reinterpret_cast<const uint32_t*>(cur[s].r16);
      join_row<D>(sym[s], cur[s].r8, r16, w);
      const uint64_t e0 = first + i0;  // the lane's first symbol of this state in the tensor
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
            const uint32_t r8 = ((k < 4 ? cur[s].r8.x : cur[s].r8.y) >> (8 * (k & 3))) & 0xff;
            u = store_element<D>(p.out, e0 + k, p.h.numel, static_cast<uint8_t>(sym[s][k]), static_cast<uint8_t>(r8),
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
    }
#pragma unroll
    for (int s = 0; s < S; ++s) cur[s] = nxt[s];
  }
#pragma unroll
  for (int s = 0; s < S; ++s) x_io[s] = x[s];
  return !bad && rp == 0;
}

// A rANS block's states (format lane 32 s + L is lane L's state s, at
// states), its rows, and the end test: every state back at L, every word
// read. The tables are built (group_sync after the state check). Ring: v3
// streams' words go through ring (rans_rows).
template <fmt::DType D, int S, bool Ring>
PZ_DEVICE PZ_FORCE_INLINE bool rans_block(const DecompressParams& p, uint64_t first, uint32_t n, const uint8_t* lookup,
                                          const uint32_t* encsym, const uint8_t* states, const uint16_t* wp,
                                          uint32_t words, const uint8_t* raw8, const uint16_t* raw16, bool contig,
                                          bool full, uint32_t& sum, uint16_t* ring) {
  const int lane = group_lane();
  uint32_t x[S];
  bool low = false;
#pragma unroll
  for (int s = 0; s < S; ++s) x[s] = get_u32(states + 4 * (fmt::kLanes * s + lane)), low |= x[s] < fmt::kStateLow;
  if (group_ballot(low)) return false;
  group_sync();  // tables complete
  bool ok;
  if constexpr (S == 2) {
    ok = full ? rans_rows<D, true, 2, false>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x, sum, ring)
              : rans_rows<D, false, 2, false>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x, sum, ring);
  } else if (contig) {
    ok = full ? rans_rows<D, true, 1, Ring>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x, sum, ring)
              : rans_rows<D, false, 1, Ring>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x, sum, ring);
  } else {
    ok = full ? rans_strided<D, true>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x[0], sum)
              : rans_strided<D, false>(p, first, n, lookup, encsym, wp, words, raw8, raw16, x[0], sum);
  }
  bool end = true;
#pragma unroll
  for (int s = 0; s < S; ++s) end = end && x[s] == fmt::kStateLow;
  return ok && !group_ballot(!end);
}

// Decodes block b's symbols into p.out, adding each element's checksum term
// to this lane's sum; returns DecodeError bits (group-uniform). S: rANS
// states a lane (format lanes / 32), 0 to take it from the header. ring:
// the group's word ring (WordRing), given to the 32-lane rANS kernel only.
template <fmt::DType D, fmt::Codec C, int S>
PZ_DEVICE uint32_t decode_symbols(const DecompressParams& p, const fmt::Layout& l, uint64_t b, DecompressSmem& s,
                                  uint32_t& sum, uint16_t* ring) {
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  uint32_t* encsym = s.encsym;
  uint16_t* freq = s.freq;
  uint8_t* lookup = s.lookup;
  int32_t* shared_tb = &s.table_bytes;

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
  const uint64_t prefix = rans::rans_prefix_bytes(table_bytes, S ? S * fmt::kLanes : h.lanes);
  const uint64_t words = prefix <= seglen ? get_u32(seg + wpos) : 0;
  if (prefix > seglen || prefix + 2 * words > seglen) return kErrSegment;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(seg + prefix);  // the launcher checks 16B alignment
  // Full blocks (all but the last) drop every per-lane bounds test.
  const uint32_t wn = static_cast<uint32_t>(words);
  const bool full = full_block<D>(h, first, n);
  bool ok;
  if constexpr (S == 0)
    ok = h.lanes == fmt::kWideLanes
             ? rans_block<D, 2, false>(p, first, n, lookup, encsym, seg + wpos + 4, wp, wn, raw8, raw16, contig, full, sum, ring)
             : rans_block<D, 1, false>(p, first, n, lookup, encsym, seg + wpos + 4, wp, wn, raw8, raw16, contig, full, sum, ring);
  else ok = rans_block<D, S, kRingKernel<C, S>>(p, first, n, lookup, encsym, seg + wpos + 4, wp, wn, raw8, raw16, contig, full, sum, ring);
  return ok ? 0u : static_cast<uint32_t>(kErrStream);
}

// Decodes block b into p.out and (v2) checks the elements it wrote against
// the block's checksum; returns DecodeError bits (group-uniform).
template <fmt::DType D, fmt::Codec C, int S>
PZ_DEVICE uint32_t decode_block(const DecompressParams& p, const fmt::Layout& l, uint64_t b, DecompressSmem& s,
                                uint16_t* ring) {
  uint32_t sum = 0;
  const uint32_t e = decode_symbols<D, C, S>(p, l, b, s, sum, ring);
  if (e || !l.nsums) return e;
  return fmt::finish_checksum(group_sum32(sum)) == get_u32(p.in + l.sums_begin + 4 * b) ? 0u : static_cast<uint32_t>(kErrChecksum);
}

// Decodes block b and ORs its errors into p.err.
template <fmt::DType D, fmt::Codec C, int S>
PZ_DEVICE PZ_FORCE_INLINE void decode_unit(const DecompressParams& p, const fmt::Layout& l, uint64_t b, DecompressSmem& s,
                                            uint16_t* ring = nullptr) {
  const uint32_t e = decode_block<D, C, S>(p, l, b, s, ring);
  if (e && group_lane() == 0) atomic_or<Scope::Device>(p.err, e);
}

// Persistent: each group strides over the blocks.
template <fmt::DType D, fmt::Codec C, int S>
PZ_DEVICE PZ_FORCE_INLINE void decompress_blocks(const DecompressParams& p, uint64_t total) {
  extern __shared__ __align__(16) uint8_t smem[];
  fmt::Layout l = fmt::layout_of(p.h);
  l.total = total;
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  DecompressSmem& s = reinterpret_cast<DecompressSmem*>(smem)[group];
  // The 32-lane rANS kernel's word rings follow the groups' tables (decompress_smem_per_group).
  uint16_t* ring = kRingKernel<C, S>
                       ? reinterpret_cast<uint16_t*>(smem + kGroupsPerCta * sizeof(DecompressSmem)) + group * kWordRing
                       : nullptr;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kGroupsPerCta;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + group; b < l.nblocks; b += stride)
    decode_unit<D, C, S>(p, l, b, s, ring);
}

// Host-parsed, or the fast path of a device-parsed decode (DecompressLaunch).
template <fmt::DType D, fmt::Codec C, int S>
PZ_DEVICE PZ_FORCE_INLINE void decompress_kernel(DecompressLaunch d) {
  const uint64_t total = d.total ? *d.total : d.p.h.total_bytes;
  if (!total) return;  // grid-uniform: not the expected stream
  decompress_blocks<D, C, S>(d.p, total);
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
  DecompressSmem& s = reinterpret_cast<DecompressSmem*>(smem)[group];
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
      PZ_BLOCK_SYNC();  // the previous job's header is no longer read
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
        // As expected: the DecompressLaunch queued after this launch decodes it.
        const bool fast = w.fast_total && !e && same_plan(parsed, w.expect);
        if (w.fast_total && local == 0) *w.fast_total = fast ? parsed.total_bytes : 0;
        if (fast) e = kSkip;
        DecompressParams& q = *reinterpret_cast<DecompressParams*>(params_bytes);
        q.in = w.in, q.out = w.out, q.err = w.err, q.h = parsed;
        head_error = e;
        if (e && e != kSkip && local == 0) atomic_or<Scope::Device>(w.err, e);
      }
      current = j;
      PZ_BLOCK_SYNC();
    }
    if (head_error) continue;  // CTA-uniform
    const fmt::Layout l = fmt::layout_of(h);
    const bool raw = h.codec == fmt::Codec::Raw;
    const uint64_t work = raw ? raw_chunks(l) : l.nblocks;
    // The job has a ticket per kGroupsPerCta blocks of the most blocks this
    // encoder (or v3's) writes for the output: the 32-lane plan's (a
    // 64-lane or fixed-code stream has as many or fewer; tickets past its
    // blocks do nothing). A stream with more (smaller blocks than any plan):
    // the job's first ticket decodes all of it.
    const bool all = work > job.work;
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
        if (h.codec == fmt::Codec::Fixed) decode_unit<D, fmt::Codec::Fixed, 1>(p, l, u, s);
        else decode_unit<D, fmt::Codec::Rans, 0>(p, l, u, s);
      }
    }
  }
}

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz::gpu
