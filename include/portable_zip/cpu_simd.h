// AVX2 paths of the CPU codec, picked at run time (cpu_codec.h keeps the
// scalar code, which every other host runs and which CI also runs on AVX2
// hosts with PZ_CPU_SIMD=0: both must give the same bytes). They code the
// same v3 steps in the same order as the scalar loops; only the lanes of a
// step move eight at a time.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format.h"
#include "rans.h"

#if defined(PZ_HOST_AVX2)
#include <immintrin.h>
#endif

namespace pz::cpu::simd {

// Whether the AVX2 paths run: the CPU has AVX2, BMI2 and POPCNT, and the
// environment does not say PZ_CPU_SIMD=0.
inline bool avx2_enabled() {
#if defined(PZ_HOST_AVX2)
  static const bool on = [] {
    const char* e = getenv("PZ_CPU_SIMD");
    if (e && e[0] == '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  }();
  return on;
#else
  return false;
#endif
}

#if defined(PZ_HOST_AVX2)

// place[m]: the byte shuffle (of 8 16-bit words, repeated in both halves)
// that hands a step's words to its renormalizing lanes, set in the 8-lane
// mask m, in lane order: lane i gets word rank(i) = the set lanes below it,
// zero-extended; lanes not in m get zero.
// select[m][i]: the lane of the i-th set bit of m, which packs a step's
// words in lane order.
struct LaneRanks {
  alignas(32) uint8_t place[256][32];
  alignas(32) uint32_t select[256][8];
  LaneRanks() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int i = 0; i < 8; ++i) {
        const int r = __builtin_popcount(m & ((1u << i) - 1));
        const bool set = m >> i & 1;
        place[m][4 * i] = set ? static_cast<uint8_t>(2 * r) : 0x80;
        place[m][4 * i + 1] = set ? static_cast<uint8_t>(2 * r + 1) : 0x80;
        place[m][4 * i + 2] = place[m][4 * i + 3] = 0x80;
        select[m][i] = 0;
        if (set) select[m][n++] = static_cast<uint32_t>(i);
      }
    }
  }
};
inline const LaneRanks& lane_ranks() {
  static const LaneRanks t;
  return t;
}

// The 8x8 transpose of 16-bit units within each 128-bit half of r[0..7]:
// afterwards r[j] holds unit j of the inputs 0..7, in order, in each half.
PZ_TARGET_AVX2 PZ_FORCE_INLINE void transpose8x16(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      b[4 * i + 2 * h] = _mm256_unpacklo_epi32(a[4 * i + h], a[4 * i + h + 2]);
      b[4 * i + 2 * h + 1] = _mm256_unpackhi_epi32(a[4 * i + h], a[4 * i + h + 2]);
    }
  for (int q = 0; q < 4; ++q) {
    r[2 * q] = _mm256_unpacklo_epi64(b[q], b[q + 4]);
    r[2 * q + 1] = _mm256_unpackhi_epi64(b[q], b[q + 4]);
  }
}

// A v3 row as the lanes hold it (lane k's 8 symbols at 8k) to columns (lane
// k's symbol of column j at 32j + k) and back: per 128-bit half, lanes
// 2i, 2i+1 become one 16-bit unit per column, and the units transpose 8x8
// (lanes 0..15 in the low halves, 16..31 in the high).
PZ_TARGET_AVX2 inline void row_to_cols(const uint8_t* row, uint8_t* cols) {
  const __m256i pair = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                        0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  __m256i r[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_shuffle_epi8(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i))),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 128 + 16 * i)), 1),
        pair);
  transpose8x16(r);
  for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(cols + 32 * j), r[j]);
}

PZ_TARGET_AVX2 inline void cols_to_row(const uint8_t* cols, uint8_t* row) {
  const __m256i unpair = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m256i r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + 32 * j));
  transpose8x16(r);
  for (int i = 0; i < 8; ++i) {
    const __m256i v = _mm256_shuffle_epi8(r[i], unpair);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * i), _mm256_castsi256_si128(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 128 + 16 * i), _mm256_extracti128_si256(v, 1));
  }
}

// The histogram of n symbols (n a multiple of 32) that mostly take one of
// the 8 distinct values top[0..7]: those are counted 32 at a time by compares
// into 8-bit lanes (summed out every 255 vectors), the rest one by one. Exact
// for any input; faster than the scalar four-table count (about 1.6x on
// bf16 weights) while the rest are rare, so compress takes it where the
// previous block's top 8 covered >= 31/32 of its symbols.
PZ_TARGET_AVX2 inline void histogram_top8(const uint8_t* syms, uint32_t n, const uint8_t* top, uint32_t* hist) {
  memset(hist, 0, fmt::kNumSymbols * sizeof(uint32_t));
  __m256i cand[8], acc[8], sum[8];
  const __m256i zero = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) cand[c] = _mm256_set1_epi8(static_cast<char>(top[c])), acc[c] = sum[c] = zero;
  int filled = 0;
  for (uint32_t i = 0; i < n; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(syms + i));
    __m256i any = zero;
    for (int c = 0; c < 8; ++c) {
      const __m256i e = _mm256_cmpeq_epi8(v, cand[c]);
      acc[c] = _mm256_sub_epi8(acc[c], e);
      any = _mm256_or_si256(any, e);
    }
    for (uint32_t rest = ~static_cast<uint32_t>(_mm256_movemask_epi8(any)); rest; rest &= rest - 1)
      ++hist[syms[i + static_cast<uint32_t>(__builtin_ctz(rest))]];
    if (++filled == 255) {
      filled = 0;
      for (int c = 0; c < 8; ++c) sum[c] = _mm256_add_epi64(sum[c], _mm256_sad_epu8(acc[c], zero)), acc[c] = zero;
    }
  }
  for (int c = 0; c < 8; ++c) {
    alignas(32) uint64_t t[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi64(sum[c], _mm256_sad_epu8(acc[c], zero)));
    hist[top[c]] += static_cast<uint32_t>(t[0] + t[1] + t[2] + t[3]);
  }
}

// The AVX2 decoder's table: per slot, the symbol, its freq - 1 and the
// slot's offset within the symbol's range (bias = slot - cum), so
// dec_step = freq * (x >> 12) + bias in one gather:
// sym | (freq - 1) << 8 | bias << 20 (each field fits: freq <= 4096).
// Filled 8 slots at a time in symbol order, a symbol's last vector running
// into the next symbol's slots (which that symbol then overwrites): dtab has
// kProbScale + 8 entries.
constexpr int kDecTableEntries = fmt::kProbScale + 8;
PZ_TARGET_AVX2 inline void build_dec_table(const uint16_t* freq, uint32_t* dtab) {
  const __m256i step = _mm256_setr_epi32(0, 1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20, 7 << 20);
  const __m256i eight = _mm256_set1_epi32(8 << 20);
  uint32_t cum = 0;
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    const uint32_t f = freq[s];
    if (!f) continue;
    __m256i v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(s) | (f - 1) << 8)), step);
    for (uint32_t t = 0; t < f; t += 8, v = _mm256_add_epi32(v, eight))
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dtab + cum + t), v);
    cum += f;
  }
}

// One block's state in decode_rows: its lane states, table, words (wp,
// words) and read position rp; [lo, hi): the bytes it may read (the stream);
// row: symbols per row (8 per lane).
struct RowStream {
  uint32_t* xs;
  const uint32_t* dtab;
  const uint8_t* wp;
  uint64_t words;
  uint64_t rp;
  const uint8_t* lo;
  const uint8_t* hi;
  uint32_t row;
};

// Whether a row of s can run unchecked: a row takes at most one word per
// symbol, so its 16-byte word loads lie in [wp + 2 (rp - row), wp + 2 rp +
// 16), which must be readable. Words past the segment's end (the first rows)
// or below its start (a corrupt stream: the row then reports it) are read but
// never used.
inline bool row_unchecked(const RowStream& s) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(s.wp) + 2 * s.rp;
  return at >= reinterpret_cast<uintptr_t>(s.lo) + 2 * s.row && at + 16 <= reinterpret_cast<uintptr_t>(s.hi);
}

// Decodes one full row of a v3 block (H 32-lane halves: 1, or 2 for v4's 64
// lanes) in each of the S streams (rans_decode_rows, scalar in
// cpu_codec.h): columns 7 .. 0, lane vectors 4H - 1 .. 0, so the
// renormalizing lanes of a step take the words just below the read position
// rp, in lane order. dtab: build_dec_table. syms[s][8k + j] gets stream s's
// lane k's symbol of column j. Returns a mask of the streams whose words ran
// out (checked rows stop there; unchecked ones, which need row_unchecked,
// finish the row with words from outside the segment and then report it). A
// lane's steps form one chain (a gather, a multiply, the refill), so a
// 32-lane block alone keeps only four chains in flight: S = 2 runs two
// blocks' rows interleaved, and a 64-lane block has eight of its own.
template <bool kChecked, int S, int H>
PZ_TARGET_AVX2 inline unsigned decode_rows(RowStream* st, uint8_t* const* syms) {
  static_assert(!kChecked || S == 1, "checked rows run one stream");
  constexpr int V = 4 * H;  // lane vectors
  const LaneRanks& lr = lane_ranks();
  __m256i X[S][V];
  int64_t rp[S];  // below 0 (unchecked rows only): the words ran out
  for (int s = 0; s < S; ++s) {
    rp[s] = static_cast<int64_t>(st[s].rp);
    for (int v = 0; v < V; ++v) X[s][v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st[s].xs + 8 * v));
  }
  const __m256i slot_mask = _mm256_set1_epi32(fmt::kProbScale - 1), zero = _mm256_setzero_si256();
  const __m256i sixteen = _mm256_set1_epi32(16);
  // Byte 0 of each 32-bit lane of vector v to bytes 4v .. 4v+3 of each half.
  const int k = 0x0c080400, o = static_cast<int>(0x80808080u);
  const __m256i pick[4] = {_mm256_setr_epi32(k, o, o, o, k, o, o, o), _mm256_setr_epi32(o, k, o, o, o, k, o, o),
                           _mm256_setr_epi32(o, o, k, o, o, o, k, o), _mm256_setr_epi32(o, o, o, k, o, o, o, k)};
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) uint8_t col[S][H][fmt::kLaneRun][fmt::kLanes];  // per half: cols_to_row's layout
  for (int j = fmt::kLaneRun - 1; j >= 0; --j) {
    __m256i sy[S][H];
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < H; ++h) sy[s][h] = zero;
    for (int v = V - 1; v >= 0; --v)
      for (int s = 0; s < S; ++s) {
        const __m256i x = X[s][v];
        const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(st[s].dtab), _mm256_and_si256(x, slot_mask), 4);
        const __m256i hi = _mm256_srli_epi32(x, fmt::kProbBits);
        const __m256i f1 = _mm256_and_si256(_mm256_srli_epi32(e, 8), slot_mask);
        const __m256i y = _mm256_add_epi32(_mm256_add_epi32(_mm256_mullo_epi32(f1, hi), hi), _mm256_srli_epi32(e, 20));
        const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);  // y < 2^16
        const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
        const unsigned cnt = static_cast<unsigned>(_mm_popcnt_u32(m));
        if (kChecked && cnt > rp[s]) return 1;
        rp[s] -= cnt;
        const uint8_t* wp = st[s].wp;
        __m128i w16;
        if (!kChecked || static_cast<uint64_t>(rp[s]) + 8 <= st[s].words) {
          w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 2 * rp[s]));
        } else {  // the last words: copy only those in range
          uint16_t t[8] = {};
          memcpy(t, wp + 2 * rp[s], 2 * cnt);
          w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
        }
        const __m256i w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(w16),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(lr.place[m])));
        X[s][v] = _mm256_or_si256(_mm256_sllv_epi32(y, _mm256_and_si256(need, sixteen)), w);
        sy[s][v / 4] = _mm256_or_si256(sy[s][v / 4], _mm256_shuffle_epi8(e, pick[v % 4]));
      }
    for (int s = 0; s < S; ++s)
      for (int h = 0; h < H; ++h)
        _mm256_store_si256(reinterpret_cast<__m256i*>(col[s][h][j]), _mm256_permutevar8x32_epi32(sy[s][h], order));
  }
  unsigned failed = 0;
  for (int s = 0; s < S; ++s) {
    for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(st[s].xs + 8 * v), X[s][v]);
    if (rp[s] < 0) failed |= 1u << s;
    st[s].rp = static_cast<uint64_t>(rp[s] < 0 ? 0 : rp[s]);
    for (int h = 0; h < H; ++h) cols_to_row(&col[s][h][0][0], syms[s] + fmt::kRowSymbols * h);
  }
  return failed;
}

// One row of one stream, unchecked where row_unchecked allows. False when the
// words run out.
template <int H>
PZ_TARGET_AVX2 inline bool decode_row(RowStream& st, uint8_t* syms) {
  return (row_unchecked(st) ? decode_rows<false, 1, H>(&st, &syms) : decode_rows<true, 1, H>(&st, &syms)) == 0;
}

// The AVX2 encoder's table: rans::enc_entry per symbol, two words each.
inline void build_enc_table(const uint32_t* encsym, const rans::DivMagic* magic, uint32_t* enc) {
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    const rans::EncEntry e = rans::enc_entry(encsym[s] & 0xffff, encsym[s] >> 16, magic[s]);
    enc[2 * s] = e.w;
    enc[2 * s + 1] = e.magic;
  }
}

// Encodes one full row of a v3 block (H 32-lane halves: 1, or 2 for v4's
// 64 lanes; rans_encode_rows, scalar in cpu_codec.h): columns 0 .. 7, lane
// vectors 0 .. 4H - 1, the words of a step's renormalizing lanes stored in
// lane order at w. cols: each 256-symbol half column by column (lane 32h + k's
// symbol of column j at 256h + 32j + k); enc: build_enc_table. Returns the
// words written. The caller leaves room for a word per symbol plus 16 bytes
// (each vector stores 16).
template <int H>
PZ_TARGET_AVX2 inline uint32_t encode_row(uint32_t* xs, const uint8_t* cols, const uint32_t* enc, uint8_t* w) {
  constexpr int V = 4 * H;
  const LaneRanks& lr = lane_ranks();
  __m256i X[V];
  for (int v = 0; v < V; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 8 * v));
  const __m256i g_bits = _mm256_set1_epi32(0xfff), c_bits = _mm256_set1_epi32(0x1fff);
  const __m256i top = _mm256_set1_epi32(fmt::kProbScale - 1), sixteen = _mm256_set1_epi32(16);
  // The low 16 bits of each 32-bit lane to the low 8 bytes of its half.
  const __m256i low_halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const int* tab = reinterpret_cast<const int*>(enc);
  uint8_t* const w0 = w;
  for (int j = 0; j < fmt::kLaneRun; ++j) {
    for (int v = 0; v < V; ++v) {
      const uint8_t* c = cols + fmt::kRowSymbols * (v / 4) + 32 * j + 8 * (v % 4);
      const __m256i sym = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
      const __m256i e = _mm256_i32gather_epi32(tab, sym, 8), mag = _mm256_i32gather_epi32(tab + 1, sym, 8);
      const __m256i g = _mm256_and_si256(e, g_bits);
      const __m256i cum = _mm256_and_si256(_mm256_srli_epi32(e, 12), c_bits);
      const __m256i shift = _mm256_srli_epi32(e, 28);
      const __m256i x = X[v];
      const __m256i need = _mm256_cmpgt_epi32(_mm256_add_epi32(_mm256_srli_epi32(x, 32 - fmt::kProbBits), g), top);
      const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
      // The low halves of the renormalizing lanes, packed in lane order.
      const __m256i sel = _mm256_shuffle_epi8(
          _mm256_permutevar8x32_epi32(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(lr.select[m]))), low_halves);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm256_castsi256_si128(_mm256_permute4x64_epi64(sel, 0x08)));
      w += 2 * _mm_popcnt_u32(m);
      const __m256i xr = _mm256_srlv_epi32(x, _mm256_and_si256(need, sixteen));
      // q = xr / freq by the magic multiply (freq 1: q = xr - 1, see rans::enc_entry).
      const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(xr, mag), 32);
      const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xr, 32), _mm256_srli_epi64(mag, 32));
      const __m256i t = _mm256_blend_epi32(even, odd, 0xaa);
      const __m256i q = _mm256_srlv_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(_mm256_sub_epi32(xr, t), 1)), shift);
      X[v] = _mm256_add_epi32(_mm256_add_epi32(_mm256_mullo_epi32(q, g), xr), cum);
    }
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + 8 * v), X[v]);
  return static_cast<uint32_t>(w - w0) / 2;
}

#endif

}  // namespace pz::cpu::simd
