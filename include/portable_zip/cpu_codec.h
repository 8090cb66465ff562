// CPU driver: the per-block code of the GPU kernels, with the 32 lanes of a
// group walked in order (which is exactly the ballot-prefix order the GPU
// uses), spread over threads. It is the cross-check for the GPU and the
// codec for CPU ranks.
//
// Shared with the GPU, one copy each: the format (format.h), the split
// (dtype_traits.h), the rANS arithmetic, table quantization and table bytes
// (rans.h: rans::quantize, write_table, parse_table, div_magic), segment
// bounds, the fixed code's table and the checksums (block.h). What differs,
// and why: the GPU computes quantize, write_table and the fixed code's top 7
// with a 32-lane group in parallel (gpu_compress.h: quantize_group,
// write_table_group), giving the same results, where the CPU calls rans.h's
// sequential versions; the lane loops below walk v3 rows column by column,
// as the GPU's lanes do in lock step, and cpu_simd.h runs eight lanes at a
// time with AVX2 (PZ_CPU_SIMD=0: the scalar loops here), decoding two blocks'
// rows interleaved (decode_pair) for twice the independent lane chains.
#pragma once
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "block.h"
#include "cpu_simd.h"

namespace pz::cpu {

using fmt::kLanes;

// Pads a segment of `used` bytes to 16 with zeros; returns the padded size.
inline uint64_t pad_segment(uint8_t* seg, uint64_t used) {
  const uint64_t padded = fmt::align_up(used, fmt::kAlign);
  memset(seg + used, 0, padded - used);
  return padded;
}

// Stored mode: the symbols as they are.
inline uint64_t store_segment(uint8_t* seg, const uint8_t* syms, uint32_t n) {
  seg[0] = fmt::kModeStored;
  memcpy(seg + 1, syms, n);
  return pad_segment(seg, 1ull + n);
}

// The fixed-length code of one block (docs/FORMAT.md); stored when no smaller.
inline uint64_t encode_fixed(uint8_t* seg, const uint8_t* syms, const uint32_t* hist, uint32_t n) {
  uint8_t table[fmt::kFixedCodes], code[fmt::kNumSymbols];
  fixed_table(hist, table);
  memset(code, fmt::kFixedEscape, sizeof code);
  for (int c = 0; c < fmt::kFixedCodes; ++c) code[table[c]] = static_cast<uint8_t>(c);
  uint64_t escapes = 0;
  for (int c = 0; c < fmt::kFixedCodes; ++c) escapes += hist[table[c]];
  escapes = n - escapes;
  if (fixed_segment_bytes(n, escapes) >= 1ull + n) return store_segment(seg, syms, n);
  seg[0] = fmt::kModeFixed;
  memcpy(seg + 1, table, fmt::kFixedCodes);
  put_u32(seg + 8, static_cast<uint32_t>(escapes));
  uint8_t* planes = seg + fmt::kFixedPrefixBytes;
  uint8_t* esc = planes + fmt::fixed_planes_bytes(n);
  memset(planes, 0, fmt::fixed_planes_bytes(n));
  for (uint32_t i = 0, e = 0; i < n; ++i) {
    const uint32_t c = code[syms[i]];
    for (int j = 0; j < 3; ++j)
      if (c >> j & 1) planes[12 * (i / kLanes) + 4 * j + (i % kLanes) / 8] |= static_cast<uint8_t>(1u << (i % 8));
    if (c == fmt::kFixedEscape) esc[e++] = syms[i];
  }
  return pad_segment(seg, fixed_segment_bytes(n, escapes));
}

// Decodes a fixed segment's symbols through emit(i, sym); DecodeError bits.
template <class Emit>
uint32_t decode_fixed(const uint8_t* seg, uint64_t seglen, uint32_t n, Emit&& emit) {
  if (seglen < fmt::kFixedPrefixBytes) return kErrSegment;
  const uint64_t escapes = get_u32(seg + 8);
  if (fixed_segment_bytes(n, escapes) > seglen) return kErrSegment;
  const uint8_t* planes = seg + fmt::kFixedPrefixBytes;
  const uint8_t* esc = planes + fmt::fixed_planes_bytes(n);
  uint64_t e = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t c = 0;
    for (int j = 0; j < 3; ++j) c |= (planes[12 * (i / kLanes) + 4 * j + (i % kLanes) / 8] >> (i % 8) & 1u) << j;
    if (c == fmt::kFixedEscape) {
      if (e >= escapes) return kErrStream;
      emit(i, esc[e++]);
    } else {
      emit(i, seg[1 + c]);
    }
  }
  return e == escapes ? 0 : kErrStream;
}

// Checksum of the 32-bit words [lo, hi) of the len bytes at p (a partial
// last word zero-padded): raw chunks, and v3 blocks. A loop of its own: it
// vectorizes (AVX2 where the CPU has it: twice SSE2's speed on this loop).
PZ_HOST_SIMD_CLONES inline uint32_t word_checksum(const uint8_t* p, uint64_t lo, uint64_t hi, uint64_t len) {
  uint32_t s = 0;
  const uint64_t whole = std::min(hi, len / 4);
  // The index as a 32-bit counter of its own (hash_term takes it mod 2^32): a
  // 64-bit k made the vector loop narrow its lanes with four shuffles a step.
  uint32_t index = static_cast<uint32_t>(lo);
  for (uint64_t k = lo; k < whole; ++k, ++index) s += fmt::hash_term(get_u32(p + 4 * k), index);
  for (uint64_t k = std::max(lo, whole); k < hi; ++k) s += fmt::hash_term(raw_word(p, k, len), static_cast<uint32_t>(k));
  return fmt::finish_checksum(s);
}

// The v2 checksum of a block's elements: one unit per symbol.
template <fmt::DType D>
PZ_HOST_SIMD_CLONES uint32_t symbol_checksum(const uint8_t* buf, uint64_t first, uint32_t n, uint64_t numel) {
  uint32_t s = 0;
  for (uint32_t i = 0; i < n; ++i)
    s += fmt::hash_term(FloatTraits<D>::unit(buf, first + i, numel), static_cast<uint32_t>(first + i));
  return fmt::finish_checksum(s);
}

// Block b's checksum over its elements in buf (the input tensor on encode,
// the output on decode), in the stream's version.
template <fmt::DType D>
uint32_t block_checksum(const fmt::Header& h, const uint8_t* buf, uint64_t first, uint32_t n) {
  if (h.version < fmt::kContigVersion) return symbol_checksum<D>(buf, first, n, h.numel);
  uint64_t lo, hi, len;
  block_words(h, first, n, &lo, &hi, &len);
  return word_checksum(buf, lo, hi, len);
}

// Checksum of raw payload chunk c (payload of len bytes at p).
inline uint32_t raw_chunk_checksum(const uint8_t* p, uint64_t c, uint64_t len) {
  const uint64_t lo = (c << fmt::kRawChunkLog2) / 4;
  return word_checksum(p, lo, std::min(((c + 1) << fmt::kRawChunkLog2), len + 3) / 4, len);
}

// The v3 rANS encode of one block's symbols (docs/FORMAT.md, "Interleaved
// rANS") with `lanes` lanes (32, or v4's 64): lane k codes symbols 8k .. 8k+7
// of each row of 8 * lanes symbols in order, one step per column, the lanes
// of a step in order. Words go to seg at `prefix` as long as prefix + 2 *
// words stays under limit; returns false (stored) when a step would reach
// it. Word stores are unconditional (a renormalization is data-dependent: a
// branch on it mispredicts), and the exact limit test runs only on steps that
// could reach it.
inline bool rans_encode_rows(const uint8_t* syms, [[maybe_unused]] const uint8_t* cols, uint32_t n, int lanes,
                             const uint32_t* encsym, const rans::DivMagic* magic, uint8_t* seg, uint32_t prefix,
                             uint64_t limit, uint32_t* x_io, uint64_t* words_out) {
  // The states in a local array: the byte stores to seg may alias x_io, so a
  // state behind a pointer is reloaded after every word (half the speed when
  // this function is not inlined).
  uint32_t x[fmt::kWideLanes];
  memcpy(x, x_io, 4 * lanes);
  uint64_t words = 0;
  const uint32_t row_syms = fmt::row_symbols(lanes);
#if defined(PZ_HOST_AVX2)
  uint32_t packed[2 * fmt::kNumSymbols];  // simd::build_enc_table
  if (cols) simd::build_enc_table(encsym, magic, packed);
#endif
  for (uint32_t row = 0; row < n; row += row_syms) {
    const uint8_t* r = syms + row;
    const uint32_t left = std::min<uint32_t>(row_syms, n - row);
#if defined(PZ_HOST_AVX2)
    // A whole row far from the limit: at most one word a symbol, and 16 bytes of slack for the vector stores.
    if (cols && left == row_syms && prefix + 2 * (words + row_syms) + 16 < limit) {
      uint8_t* w = seg + prefix + 2 * words;
      words += lanes == fmt::kLanes ? simd::encode_row<1>(x, cols + row, packed, w)
                                    : simd::encode_row<2>(x, cols + row, packed, w);
      continue;
    }
#endif
    for (int j = 0; j < fmt::kLaneRun; ++j) {
      const int active = row_lanes(left, j, lanes);
      if (prefix + 2 * (words + lanes + 1) >= limit) {  // near the limit: count, then store only what is needed
        uint64_t count = 0;
        for (int k = 0; k < active; ++k) count += rans::enc_renorm_needed(x[k], encsym[r[fmt::kLaneRun * k + j]] & 0xffff);
        if (prefix + 2 * (words + count) >= limit) return false;
        for (int k = 0; k < active; ++k) {
          const uint32_t sym = r[fmt::kLaneRun * k + j];
          const uint32_t es = encsym[sym];
          if (rans::enc_renorm_needed(x[k], es & 0xffff)) {
            seg[prefix + 2 * words] = static_cast<uint8_t>(x[k]);
            seg[prefix + 2 * words + 1] = static_cast<uint8_t>(x[k] >> 8);
            ++words;
            x[k] >>= 16;
          }
          x[k] = rans::enc_put_magic(x[k], es & 0xffff, es >> 16, magic[sym]);
        }
        continue;
      }
      uint8_t* w = seg + prefix + 2 * words;  // every store, the last unneeded one too, is below limit
      for (int k = 0; k < active; ++k) {
        const uint32_t sym = r[fmt::kLaneRun * k + j];
        const uint32_t es = encsym[sym];
        const uint32_t need = rans::enc_renorm_needed(x[k], es & 0xffff);
        w[0] = static_cast<uint8_t>(x[k]);  // overwritten unless needed
        w[1] = static_cast<uint8_t>(x[k] >> 8);
        w += 2 * need;
        const uint32_t xr = need ? x[k] >> 16 : x[k];
        x[k] = rans::enc_put_magic(xr, es & 0xffff, es >> 16, magic[sym]);
      }
      words = static_cast<uint64_t>(w - (seg + prefix)) / 2;
    }
  }
  memcpy(x_io, x, 4 * lanes);
  *words_out = words;
  return true;
}

// The split and the join of n symbols whose elements all exist (no bounds
// tests): loops of their own, built for AVX2 too (PZ_HOST_SIMD_CLONES), since
// they vectorize. src/out point at the block's first symbol's elements.
template <fmt::DType D>
PZ_HOST_SIMD_CLONES void split_whole(const uint8_t* src, uint32_t n, uint8_t* syms, uint8_t* raw8, uint8_t* raw16) {
  for (uint32_t i = 0; i < n; ++i) {
    const Split sp = FloatTraits<D>::split(src, i, ~0ull);
    syms[i] = sp.sym;
    raw8[i] = sp.raw8;
    if constexpr (fmt::has_plane16(D)) memcpy(raw16 + 2 * i, &sp.raw16, 2);  // little-endian hosts
  }
}

template <fmt::DType D>
PZ_HOST_SIMD_CLONES void join_whole(uint8_t* out, uint32_t n, const uint8_t* syms, const uint8_t* raw8, const uint8_t* raw16) {
  for (uint32_t i = 0; i < n; ++i) {
    uint16_t r16 = 0;
    if constexpr (fmt::has_plane16(D)) memcpy(&r16, raw16 + 2 * i, 2);
    FloatTraits<D>::join(out, i, ~0ull, syms[i], raw8[i], r16);
  }
}

// A thread's guess at its next block's 8 most frequent symbols (from its
// last block), and whether they covered enough of it for
// simd::histogram_top8.
struct HistHint {
  uint8_t top[8];
  bool vec = false;
};

// Sets hint from a block's histogram: its top 8 symbols (distinct), and
// whether they cover >= 31/32 of the block's n symbols.
inline void update_hint(const uint32_t* hist, uint32_t n, HistHint* hint) {
  uint32_t tc[8];
  int k = 0;
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    const uint32_t c = hist[s];
    int pos;
    if (k < 8)
      pos = k++;
    else if (c > tc[7])
      pos = 7;
    else
      continue;
    for (; pos > 0 && tc[pos - 1] < c; --pos) tc[pos] = tc[pos - 1], hint->top[pos] = hint->top[pos - 1];
    tc[pos] = c, hint->top[pos] = static_cast<uint8_t>(s);
  }
  uint64_t covered = 0;
  for (int c = 0; c < 8; ++c) covered += tc[c];
  hint->vec = 32 * covered >= 31ull * n;
}

// Pass 1 of a block: split, histogram, raw planes, as three loops: the split
// vectorizes on its own; the histogram counts into four tables, summed after
// (skewed data sends most symbols to one counter, and one table would chain
// every increment through a store and a load); cols (may be null) gets the
// symbols again, each row column by column (lane k's symbol of column j at
// 32j + k), for the AVX2 encoder's 8-lane loads.
template <fmt::DType D>
PZ_FORCE_INLINE void split_block(const uint8_t* in, const fmt::Header& h, const fmt::Layout& l, uint64_t first,
                                 uint32_t n, uint8_t* stream, uint8_t* syms, uint8_t* cols, uint32_t* hist,
                                 HistHint* hint) {
  using T = FloatTraits<D>;
  constexpr bool plane16 = fmt::has_plane16(D);
  uint8_t* raw8 = stream + l.raw_begin + first;
  uint8_t* raw16 = stream + l.plane16_begin + 2 * first;
  const bool whole = !(D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2) || 2 * (first + n) <= h.numel;
  if (whole) {  // every symbol has all its elements: no bounds tests
    split_whole<D>(in + first * fmt::symbol_bytes(D), n, syms, raw8, raw16);
  } else {
    for (uint32_t i = 0; i < n; ++i) {
      const Split sp = T::split(in, first + i, h.numel);
      syms[i] = sp.sym;
      write_raw(stream, l, plane16, first + i, sp);
    }
  }
#if defined(PZ_HOST_AVX2)
  if (hint && hint->vec && n % 32 == 0 && simd::avx2_enabled()) {
    simd::histogram_top8(syms, n, hint->top, hist);
  } else
#endif
  {
    uint32_t h4[4][fmt::kNumSymbols] = {};
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) ++h4[0][syms[i]], ++h4[1][syms[i + 1]], ++h4[2][syms[i + 2]], ++h4[3][syms[i + 3]];
    for (; i < n; ++i) ++h4[0][syms[i]];
    for (int s = 0; s < fmt::kNumSymbols; ++s) hist[s] = h4[0][s] + h4[1][s] + h4[2][s] + h4[3][s];
  }
  if (hint) update_hint(hist, n, hint);
  if (cols)
    for (uint32_t row = 0; row < n; row += fmt::kRowSymbols) {
      const uint32_t left = std::min<uint32_t>(fmt::kRowSymbols, n - row);
#if defined(PZ_HOST_AVX2)
      if (left == fmt::kRowSymbols) {  // cols is set only where the AVX2 paths run
        simd::row_to_cols(syms + row, cols + row);
        continue;
      }
#endif
      for (uint32_t p = 0; p < left; ++p) cols[row + (p % fmt::kLaneRun) * kLanes + p / fmt::kLaneRun] = syms[row + p];
    }
}

// Encodes block b into seg (capacity max_segment_bytes); returns its padded size.
// Also writes the block's raw bits into the stream's raw planes and its checksum.
// The encoder writes the current version only (v3 lanes).
template <fmt::DType D>
uint64_t encode_block(const uint8_t* in, const fmt::Header& h, const fmt::Layout& l, uint64_t b,
                      uint8_t* stream, uint8_t* seg, uint8_t* syms, HistHint* hint = nullptr) {
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);
  uint32_t hist[fmt::kNumSymbols];
  // syms: room for two blocks (compress()); the second holds the column-major copy.
  uint8_t* cols = simd::avx2_enabled() && h.codec == fmt::Codec::Rans ? syms + (1u << h.block_log2) : nullptr;
  split_block<D>(in, h, l, first, n, stream, syms, cols, hist, simd::avx2_enabled() ? hint : nullptr);
  if (l.nsums) put_u32(stream + l.sums_begin + 4 * b, block_checksum<D>(h, in, first, n));
  if (h.codec == fmt::Codec::Fixed) return encode_fixed(seg, syms, hist, n);
  uint16_t freq[fmt::kNumSymbols];
  rans::quantize(hist, n, freq);
  const uint64_t limit = 1ull + n;
  // The table goes through a buffer: seg has room for max_segment_bytes(n)
  // only (the segments are packed in the output), which a small block's
  // table can pass before the prefix test sends it to stored mode.
  uint8_t table[1 + 32 + 2 * fmt::kNumSymbols];
  const int table_bytes = rans::write_table(freq, table);
  const int lanes = h.lanes;
  const uint32_t prefix = rans::rans_prefix_bytes(table_bytes, lanes);
  if (prefix < limit) memcpy(seg + 1, table, table_bytes);
  uint32_t encsym[fmt::kNumSymbols];
  build_encsym(freq, encsym);
  rans::DivMagic magic[fmt::kNumSymbols];  // the GPU's exact divide, also faster than div here
  for (int s = 0; s < fmt::kNumSymbols; ++s) magic[s] = rans::div_magic(freq[s]);
  uint32_t x[fmt::kWideLanes];
  for (int k = 0; k < lanes; ++k) x[k] = fmt::kStateLow;
  uint64_t words = 0;
  if (prefix >= limit || !rans_encode_rows(syms, cols, n, lanes, encsym, magic, seg, prefix, limit, x, &words))
    return store_segment(seg, syms, n);
  seg[0] = fmt::kModeRans;
  const uint32_t wpos = static_cast<uint32_t>(fmt::align_up(1 + table_bytes, 4));
  memset(seg + 1 + table_bytes, 0, wpos - 1 - table_bytes);
  put_u32(seg + wpos, static_cast<uint32_t>(words));
  for (int k = 0; k < lanes; ++k) put_u32(seg + wpos + 4 + 4 * k, x[k]);
  return pad_segment(seg, prefix + 2 * words);
}

// A rANS segment parsed: its tables, words and lane states, ready for its
// steps.
struct RansSegment {
  uint16_t freq[fmt::kNumSymbols];
  uint32_t encsym[fmt::kNumSymbols];
  // The AVX2 rows' table (one gather per 8 symbols): v3 blocks with a full row.
  const uint32_t* dtab = nullptr;
#if defined(PZ_HOST_AVX2)
  uint32_t dtab_buf[simd::kDecTableEntries];
#endif
  // The scalar steps' table: v1/v2 streams, a v3 block's partial last row,
  // every step without AVX2 (built only then).
  uint8_t lookup[fmt::kProbScale];
  const uint8_t* wp;
  uint64_t words, rp;  // rp: the read position, words below it are still to be read
  int lanes;           // the header's
  uint32_t x[fmt::kWideLanes];
};

// Parses the rANS segment (seg, seglen) of a block of n symbols into r.
// Returns DecodeError bits.
inline uint32_t open_rans(const uint8_t* seg, uint64_t seglen, [[maybe_unused]] const fmt::Header& h, uint32_t n,
                          RansSegment* r) {
  const int table_bytes = rans::parse_table(seg + 1, seg + seglen, r->freq);
  if (table_bytes < 0) return kErrTable;
  build_encsym(r->freq, r->encsym);
  r->lanes = h.lanes;
  r->dtab = nullptr;
  const uint32_t row_syms = fmt::row_symbols(r->lanes);
#if defined(PZ_HOST_AVX2)
  if (simd::avx2_enabled() && h.version >= fmt::kContigVersion && n >= row_syms) {
    simd::build_dec_table(r->freq, r->dtab_buf);
    r->dtab = r->dtab_buf;
  }
#endif
  if (!r->dtab || n % row_syms)
    for (int s = 0; s < fmt::kNumSymbols; ++s) memset(r->lookup + (r->encsym[s] >> 16), s, r->freq[s]);
  const uint64_t wpos = fmt::align_up(1 + table_bytes, 4);
  const uint64_t prefix = rans::rans_prefix_bytes(table_bytes, r->lanes);
  if (prefix > seglen) return kErrSegment;
  r->words = get_u32(seg + wpos);
  if (prefix + 2 * r->words > seglen) return kErrSegment;
  r->wp = seg + prefix;
  for (int k = 0; k < r->lanes; ++k) {
    r->x[k] = get_u32(seg + wpos + 4 + 4 * k);
    if (r->x[k] < fmt::kStateLow) return kErrStream;
  }
  r->rp = r->words;
  return 0;
}

// A decoded segment must have read every word and left every lane at L.
inline uint32_t close_rans(const RansSegment& r) {
  if (r.rp != 0) return kErrStream;
  for (int k = 0; k < r.lanes; ++k)
    if (r.x[k] != fmt::kStateLow) return kErrStream;
  return 0;
}

#if defined(PZ_HOST_AVX2)
inline simd::RowStream row_stream(RansSegment& r, const uint8_t* stream, const fmt::Layout& l) {
  return {r.x, r.dtab, r.wp, r.words, r.rp, stream, stream + l.total, fmt::row_symbols(r.lanes)};
}
#endif

// The v3 rANS decode of one block's n symbols into syms (the inverse of
// rans_encode_rows): rows last to first, columns 7 .. 0, the lanes of a step
// in reverse order, so a lane that renormalizes takes the word just below
// the read position (the same words, in the same lanes, as the forward
// assignment of docs/FORMAT.md) and every step is one pass. False when the
// words run out.
inline bool rans_decode_rows(const uint8_t* stream, const fmt::Layout& l, RansSegment& r, uint32_t n, uint8_t* syms) {
  const uint32_t row_syms = fmt::row_symbols(r.lanes);
  const uint32_t rows = (n + row_syms - 1) / row_syms;
  uint32_t* x = r.x;
  for (uint32_t row = rows; row-- > 0;) {
    const uint32_t base = row * row_syms;
    const uint32_t left = std::min<uint32_t>(row_syms, n - base);
#if defined(PZ_HOST_AVX2)
    if (r.dtab && left == row_syms) {
      simd::RowStream st = row_stream(r, stream, l);
      if (!(r.lanes == fmt::kLanes ? simd::decode_row<1>(st, syms + base) : simd::decode_row<2>(st, syms + base)))
        return false;
      r.rp = st.rp;
      continue;
    }
#endif
    for (int j = fmt::kLaneRun - 1; j >= 0; --j) {
      const int active = row_lanes(left, j, r.lanes);
      for (int k = active - 1; k >= 0; --k) {
        const uint32_t slot = x[k] & (fmt::kProbScale - 1);
        const uint8_t sym = r.lookup[slot];
        const uint32_t es = r.encsym[sym];
        uint32_t y = rans::dec_step(x[k], es & 0xffff, es >> 16);
        syms[base + fmt::kLaneRun * k + j] = sym;
        if (y < fmt::kStateLow) {  // a branch: rare enough to predict, and it keeps rp off the state chain
          if (r.rp == 0) return false;
          --r.rp;
          y = (y << 16) | r.wp[2 * r.rp] | (uint32_t(r.wp[2 * r.rp + 1]) << 8);
        }
        x[k] = y;
      }
    }
  }
  return true;
}

// A block's elements from its symbols and raw planes, in one forward pass
// (rows decode last to first: writing the output, and reading the raw plane,
// backwards row by row ran at a third of the speed).
template <fmt::DType D>
void join_symbols(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l, uint64_t first, uint32_t n,
                  const uint8_t* syms, uint8_t* out) {
  const uint8_t* raw8 = stream + l.raw_begin + first;
  if (!(D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2) || 2 * (first + n) <= h.numel)
    join_whole<D>(out + first * fmt::symbol_bytes(D), n, syms, raw8, stream + l.plane16_begin + 2 * first);
  else
    for (uint32_t i = 0; i < n; ++i)
      FloatTraits<D>::join(out, first + i, h.numel, syms[i], raw8[i], raw16_at(stream, l, fmt::has_plane16(D), first + i));
}

// Two v3 blocks' symbols, between their rows and their join: each decoding
// run's own buffer (thread-local storage here would be allocated on a
// thread's first use, and glibc aborts when that allocation fails).
struct BlockSyms {
  uint8_t* syms[2];
};

// Decodes block b's symbols. Returns DecodeError bits (0 = ok). Never touches
// memory outside the validated stream or the numel-element output.
template <fmt::DType D>
uint32_t decode_symbols(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l, uint64_t b, uint8_t* out,
                        BlockSyms& scratch) {
  using T = FloatTraits<D>;
  const bool plane16 = fmt::has_plane16(D);
  uint64_t sb, se;
  if (!segment_bounds(stream, h, l, b, &sb, &se)) return kErrOffsets;
  const uint8_t* seg = stream + l.coded_begin + sb;
  const uint64_t seglen = se - sb;
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);
  auto emit = [&](uint64_t i, uint8_t sym) {
    T::join(out, first + i, h.numel, sym, stream[l.raw_begin + first + i], raw16_at(stream, l, plane16, first + i));
  };
  if (seg[0] == fmt::kModeStored) {
    if (seglen < 1ull + n) return kErrSegment;
    for (uint32_t i = 0; i < n; ++i) emit(i, seg[1 + i]);
    return 0;
  }
  if (seg[0] == fmt::kModeFixed && h.codec == fmt::Codec::Fixed) return decode_fixed(seg, seglen, n, emit);
  if (seg[0] != fmt::kModeRans || h.codec != fmt::Codec::Rans) return kErrSegment;
  RansSegment r;
  if (const uint32_t e = open_rans(seg, seglen, h, n, &r)) return e;
  if (h.version >= fmt::kContigVersion) {
    uint8_t* syms = scratch.syms[0];
    if (!rans_decode_rows(stream, l, r, n, syms)) return kErrStream;
    join_symbols<D>(stream, h, l, first, n, syms, out);
  } else {  // v1/v2: symbol j of the block on lane j mod 32 at step j div 32
    uint32_t* x = r.x;
    for (uint32_t s = (n + kLanes - 1) / kLanes; s-- > 0;) {
      const uint32_t base = s * kLanes;
      const int active = static_cast<int>(std::min<uint32_t>(kLanes, n - base));
      int count = 0;
      for (int k = 0; k < active; ++k) {
        const uint8_t sym = r.lookup[x[k] & (fmt::kProbScale - 1)];
        const uint32_t es = r.encsym[sym];
        x[k] = rans::dec_step(x[k], es & 0xffff, es >> 16);
        emit(base + k, sym);
        count += x[k] < fmt::kStateLow;
      }
      if (static_cast<uint64_t>(count) > r.rp) return kErrStream;
      uint64_t rr = r.rp - count;
      for (int k = 0; k < active; ++k)
        if (x[k] < fmt::kStateLow) {
          x[k] = (x[k] << 16) | r.wp[2 * rr] | (uint32_t(r.wp[2 * rr + 1]) << 8);
          ++rr;
        }
      r.rp -= count;
    }
  }
  return close_rans(r);
}

// Block b's output against its checksum (v2 and later).
template <fmt::DType D>
uint32_t check_block(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l, uint64_t b, const uint8_t* out) {
  if (!l.nsums) return 0;
  const uint32_t want = get_u32(stream + l.sums_begin + 4 * b);
  return block_checksum<D>(h, out, b << h.block_log2, fmt::block_symbols(h, l, b)) == want ? 0 : kErrChecksum;
}

// Decodes block b and (v2) checks its output against its checksum.
template <fmt::DType D>
uint32_t decode_block(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l, uint64_t b, uint8_t* out,
                      BlockSyms& scratch) {
  if (const uint32_t e = decode_symbols<D>(stream, h, l, b, out, scratch)) return e;
  return check_block<D>(stream, h, l, b, out);
}

// Blocks b and b + 1 with their rows interleaved (simd::decode_rows with two
// streams: twice the chains in flight), when both are v3 rANS segments of
// whole rows on the AVX2 path; *done: how many blocks the call decoded (0:
// not such a pair, nothing done; decode_block then takes b). Returns what
// decode_block on b, then on b + 1 if b is good, would: b + 1's output is not
// written before b is decoded and checked.
template <fmt::DType D>
uint32_t decode_pair(const uint8_t* stream, const fmt::Header& h, const fmt::Layout& l, uint64_t b, uint8_t* out,
                     BlockSyms& scratch, int* done) {
  *done = 0;
#if defined(PZ_HOST_AVX2)
  // Wide (64-lane) blocks carry eight lane vectors of chains on their own.
  if (!simd::avx2_enabled() || h.version < fmt::kContigVersion || h.codec != fmt::Codec::Rans || h.lanes != kLanes)
    return 0;
  uint64_t sb[2], se[2];
  uint32_t n[2];
  for (int i = 0; i < 2; ++i) {
    n[i] = fmt::block_symbols(h, l, b + i);
    if (!segment_bounds(stream, h, l, b + i, &sb[i], &se[i]) || stream[l.coded_begin + sb[i]] != fmt::kModeRans ||
        n[i] % fmt::kRowSymbols)
      return 0;
  }
  RansSegment r[2];
  uint32_t err[2];
  for (int i = 0; i < 2; ++i) err[i] = open_rans(stream + l.coded_begin + sb[i], se[i] - sb[i], h, n[i], &r[i]);
  *done = 1;
  if (err[0]) return err[0];
  uint8_t* syms[2] = {scratch.syms[0], scratch.syms[1]};
  simd::RowStream st[2] = {row_stream(r[0], stream, l), row_stream(r[1], stream, l)};
  uint32_t row[2] = {n[0] / fmt::kRowSymbols, n[1] / fmt::kRowSymbols};
  while (row[0] && row[1] && !err[1]) {
    --row[0], --row[1];
    uint8_t* at[2] = {syms[0] + row[0] * fmt::kRowSymbols, syms[1] + row[1] * fmt::kRowSymbols};
    if (simd::row_unchecked(st[0]) && simd::row_unchecked(st[1])) {
      const unsigned failed = simd::decode_rows<false, 2, 1>(st, at);
      if (failed & 1) return kErrStream;
      if (failed & 2) err[1] = kErrStream;
      continue;
    }
    if (!simd::decode_row<1>(st[0], at[0])) return kErrStream;
    if (!simd::decode_row<1>(st[1], at[1])) err[1] = kErrStream;
  }
  while (row[0]) {
    --row[0];
    if (!simd::decode_row<1>(st[0], syms[0] + row[0] * fmt::kRowSymbols)) return kErrStream;
  }
  while (row[1] && !err[1]) {
    --row[1];
    if (!simd::decode_row<1>(st[1], syms[1] + row[1] * fmt::kRowSymbols)) err[1] = kErrStream;
  }
  r[0].rp = st[0].rp, r[1].rp = st[1].rp;
  join_symbols<D>(stream, h, l, b << h.block_log2, n[0], syms[0], out);
  if (const uint32_t e = close_rans(r[0])) return e;
  if (const uint32_t e = check_block<D>(stream, h, l, b, out)) return e;
  *done = 2;
  if (err[1]) return err[1];
  join_symbols<D>(stream, h, l, (b + 1) << h.block_log2, n[1], syms[1], out);
  if (const uint32_t e = close_rans(r[1])) return e;
  return check_block<D>(stream, h, l, b + 1, out);
#else
  (void)stream, (void)h, (void)l, (void)b, (void)out, (void)scratch;
  return 0;
#endif
}

// The threads parallel_for(count, threads, f) runs: thread t gets the t-th
// contiguous run of [0, count), ascending (callers that keep per-thread
// output in run order size it by this).
inline int thread_count(uint64_t count, int threads) {
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(count, static_cast<uint64_t>(std::max(1, threads)))));
}

// A thread's lazily allocated thread-local storage, taken before its work
// allocates: glibc aborts the process when that allocation fails. This
// module's block (it holds the statically linked libstdc++'s exception
// globals, which a throw touches) comes with any of its variables, this one;
// uncaught_exceptions takes a shared libstdc++'s, where calls resolve to it.
// A thread first proves that a few KiB are there and returns false, leaving
// its run to the caller, if not. The probes take turns, and the caller holds
// a turn while it starts threads, so no other thread takes those KiB first.
inline thread_local volatile char tls_anchor;
// A turn is an atomic flag, not a mutex (a timed or try-locked pthread mutex
// needs glibc 2.30-2.34 symbols, past what manylinux_2_28 wheels may use),
// waited for at most 100 ms, and a forked child starts with it free.
struct TlsTurn {
  bool held = false;
  TlsTurn() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    for (int i = 0; !(held = !flag().exchange(true, std::memory_order_acquire)); ++i) {
      if (std::chrono::steady_clock::now() >= until) return;
      if (i < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  ~TlsTurn() {
    if (held) flag().store(false, std::memory_order_release);
  }
  TlsTurn(const TlsTurn&) = delete;
  TlsTurn& operator=(const TlsTurn&) = delete;
  static std::atomic<bool>& flag() {
    static std::atomic<bool> busy{false};
    static const int reset_in_child = pthread_atfork(nullptr, nullptr, [] { busy.store(false); });
    static_cast<void>(reset_in_child);
    return busy;
  }
};
inline bool touch_thread_locals() {
  const TlsTurn turn;
  void* probe = malloc(16 << 10);
  if (!probe) return false;
  free(probe);
  tls_anchor = 1;
  static_cast<void>(std::uncaught_exceptions());
  return true;
}

// Runs f over the runs on up to `threads` threads. Every thread takes its
// thread-local storage before any run starts allocating; a run whose thread
// cannot be started, or finds no memory for that storage, falls to the
// caller; an exception from any run is rethrown here after every thread has
// joined. None of these may terminate the process.
template <class F>
void parallel_for(uint64_t count, int threads, F&& f) {
  threads = thread_count(count, threads);
  touch_thread_locals();  // the caller throws too (a thread that cannot start, a run's error)
  if (threads == 1) {
    f(0, 0, count);
    return;
  }
  const uint64_t chunk = (count + threads - 1) / threads;
  std::vector<std::exception_ptr> errors(threads);
  std::vector<char> orphan(threads, 1);  // run t is the caller's
  auto run = [&](int t) {
    const uint64_t lo = std::min(count, t * chunk), hi = std::min(count, lo + chunk);
    try {
      f(t, lo, hi);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  int started = 1;
  try {
    pool.reserve(threads - 1);
    const TlsTurn turn;
    for (; started < threads; ++started)
      pool.emplace_back([&, t = started] {
        orphan[t] = !touch_thread_locals();
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        if (!orphan[t]) run(t);
      });
  } catch (const std::exception&) {  // no thread or memory to spare
  }
  while (ready.load() < started - 1) std::this_thread::yield();
  go = true;
  for (int t = 0; t < threads; ++t)
    if (orphan[t]) run(t);
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Compresses into out (capacity >= fmt::max_stream_bytes(h)); returns total
// bytes. The bytes of out past the total are left unspecified: segments are
// staged there before they move into place.
inline uint64_t compress(const uint8_t* in, fmt::Header h, uint8_t* out, int threads) {
  const fmt::Layout l = fmt::layout_of(h);
  if (h.codec == fmt::Codec::Raw) {
    h.total_bytes = l.coded_begin;
    fmt::write_header(h, out);
    const uint64_t len = l.raw_end - l.raw_begin;
    if (h.numel) memcpy(out + l.raw_begin, in, len);
    memset(out + l.raw_end, 0, l.sums_begin - l.raw_end);
    parallel_for(l.nsums, threads, [&](int, uint64_t lo, uint64_t hi) {
      for (uint64_t c = lo; c < hi; ++c) put_u32(out + l.sums_begin + 4 * c, raw_chunk_checksum(in, c, len));
    });
    return h.total_bytes;
  }
  // Each thread encodes its blocks in order, packed, straight into out from
  // the worst-case start of its first block (the blocks before it all
  // stored): a segment then starts no later than its worst case and writes
  // no further than its worst-case end, so no thread reaches the next one's
  // range. The threads' runs then move down into place, in thread order (a
  // run's new place may overlap its old one, never a later run's).
  const uint64_t seg_cap = fmt::max_segment_bytes(1ull << h.block_log2);
  const int nthreads = thread_count(l.nblocks, threads);
  std::vector<uint64_t> sizes(l.nblocks), run_lo(nthreads, 0), run_bytes(nthreads, 0);
  uint8_t* coded = out + l.coded_begin;
  parallel_for(l.nblocks, nthreads, [&](int t, uint64_t lo, uint64_t hi) {
    std::vector<uint8_t> syms(2ull << h.block_log2);  // a block's symbols, then their column-major copy
    HistHint hint;
    uint64_t at = lo * seg_cap;
    run_lo[t] = lo;
    for (uint64_t b = lo; b < hi; ++b) {
      sizes[b] = PZ_DISPATCH_CODED_DTYPE(h.dtype, D, [&] {
        return static_cast<int>(encode_block<D>(in, h, l, b, out, coded + at, syms.data(), &hint));
      });
      at += sizes[b];
    }
    run_bytes[t] = at - lo * seg_cap;
  });
  uint64_t acc = 0;
  for (int t = 0; t < nthreads; ++t) {
    if (run_bytes[t] && acc != run_lo[t] * seg_cap) memmove(coded + acc, coded + run_lo[t] * seg_cap, run_bytes[t]);
    acc += run_bytes[t];
  }
  h.total_bytes = l.coded_begin + acc;
  fmt::write_header(h, out);
  // Zero the alignment gaps between regions so the bytes are deterministic.
  memset(out + l.raw_begin + l.nsym, 0, l.plane16_begin - (l.raw_begin + l.nsym));
  memset(out + l.raw_end, 0, l.offsets_begin - l.raw_end);
  memset(out + l.sums_begin + 4 * l.nsums, 0, l.coded_begin - (l.sums_begin + 4 * l.nsums));
  uint64_t end = 0;
  for (uint64_t b = 0; b < l.nblocks; ++b) fmt::put_u64(out + l.offsets_begin + 8 * b, end += sizes[b]);
  return h.total_bytes;
}

// Decodes a stream whose header parsed Ok against its length. out holds
// numel elements. Returns DecodeError bits.
inline uint32_t decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, int threads) {
  const fmt::Layout l = fmt::layout_of(h);
  std::atomic<uint32_t> err{0};
  if (h.codec == fmt::Codec::Raw) {
    // Per chunk: verify (v2), then copy; a chunk that fails is not written,
    // so no corrupted byte (and no invalid bool) reaches the output.
    const uint64_t len = l.raw_end - l.raw_begin;
    const uint8_t* p = in + l.raw_begin;
    const bool is_bool = h.dtype == fmt::DType::Bool;
    const uint64_t chunks = (len + (1ull << fmt::kRawChunkLog2) - 1) >> fmt::kRawChunkLog2;
    parallel_for(chunks, threads, [&](int, uint64_t lo, uint64_t hi) {
      for (uint64_t c = lo; c < hi; ++c) {
        const uint64_t a = c << fmt::kRawChunkLog2, z = std::min<uint64_t>(len, a + (1ull << fmt::kRawChunkLog2));
        if (l.nsums && raw_chunk_checksum(p, c, len) != get_u32(in + l.sums_begin + 4 * c)) {
          err.fetch_or(kErrChecksum);
          continue;
        }
        if (is_bool) {
          uint8_t bad = 0;
          for (uint64_t i = a; i < z; ++i) bad |= p[i] & 0xFE;
          if (bad) {
            err.fetch_or(kErrBool);
            continue;
          }
        }
        memcpy(out + a, p + a, z - a);
      }
    });
    return err.load();
  }
  parallel_for(l.nblocks, threads, [&](int, uint64_t lo, uint64_t hi) {
    const std::unique_ptr<uint8_t[]> buf(new uint8_t[2ull << h.block_log2]);  // not zeroed: rows write what joins read
    BlockSyms scratch{{buf.get(), buf.get() + (1ull << h.block_log2)}};
    for (uint64_t b = lo; b < hi;) {
      int done = 0;
      const int e = PZ_DISPATCH_CODED_DTYPE(h.dtype, D, [&] {
        const uint32_t pair = b + 1 < hi ? decode_pair<D>(in, h, l, b, out, scratch, &done) : 0;
        return static_cast<int>(done ? pair : (done = 1, decode_block<D>(in, h, l, b, out, scratch)));
      });
      if (e) {
        err.fetch_or(static_cast<uint32_t>(e));
        return;
      }
      b += done;
    }
  });
  return err.load();
}

}  // namespace pz::cpu
