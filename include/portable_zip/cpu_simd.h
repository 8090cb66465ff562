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

// rank[m][i]: how many lanes below lane i are set in the 8-lane mask m, the
// permutation that hands the words of a step to its renormalizing lanes in
// lane order.
// select[m][i]: the lane of the i-th set bit of m, which packs a step's
// words in lane order.
struct LaneRanks {
  alignas(32) uint32_t rank[256][8];
  alignas(32) uint32_t select[256][8];
  LaneRanks() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int i = 0; i < 8; ++i) {
        rank[m][i] = static_cast<uint32_t>(__builtin_popcount(m & ((1u << i) - 1)));
        select[m][i] = 0;
        if (m >> i & 1) select[m][n++] = static_cast<uint32_t>(i);
      }
    }
  }
};
inline const LaneRanks& lane_ranks() {
  static const LaneRanks t;
  return t;
}

// Decodes one full 256-symbol row of a v3 block (rans_decode_rows, scalar in
// cpu_codec.h): columns 7 .. 0, lane vectors 3 .. 0, so the renormalizing
// lanes of a step take the words just below the read position rp, in lane
// order. syms[8k + j] gets lane k's symbol of column j. lookup has 3 readable
// bytes past its 4096 (a gather reads 4). False when the words run out.
PZ_TARGET_AVX2 inline bool decode_row(uint32_t* xs, const uint8_t* lookup, const uint32_t* encsym, const uint8_t* wp,
                                      uint64_t words, uint64_t* rp_io, uint8_t* syms) {
  const LaneRanks& lr = lane_ranks();
  __m256i X[4];
  for (int v = 0; v < 4; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 8 * v));
  const __m256i slot_mask = _mm256_set1_epi32(fmt::kProbScale - 1), low16 = _mm256_set1_epi32(0xffff);
  const __m256i byte = _mm256_set1_epi32(0xff), zero = _mm256_setzero_si256();
  uint64_t rp = *rp_io;
  alignas(32) uint32_t col[fmt::kLaneRun][fmt::kLanes];
  for (int j = fmt::kLaneRun - 1; j >= 0; --j) {
    for (int v = 3; v >= 0; --v) {
      const __m256i slot = _mm256_and_si256(X[v], slot_mask);
      const __m256i sym = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(lookup), slot, 1), byte);
      const __m256i es = _mm256_i32gather_epi32(reinterpret_cast<const int*>(encsym), sym, 4);
      // rans::dec_step: freq * (x >> 12) + slot - cum, in 32 bits.
      const __m256i y = _mm256_sub_epi32(
          _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(es, low16), _mm256_srli_epi32(X[v], fmt::kProbBits)), slot),
          _mm256_srli_epi32(es, 16));
      const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);  // y < 2^16
      const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
      const unsigned cnt = static_cast<unsigned>(_mm_popcnt_u32(m));
      if (cnt > rp) return false;
      rp -= cnt;
      __m128i w16;
      if (rp + 8 <= words) {
        w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 2 * rp));
      } else {  // the last words: copy only those in range
        uint16_t t[8] = {};
        memcpy(t, wp + 2 * rp, 2 * cnt);
        w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
      }
      const __m256i w = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(w16),
                                                    _mm256_load_si256(reinterpret_cast<const __m256i*>(lr.rank[m])));
      X[v] = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), w), need);
      _mm256_store_si256(reinterpret_cast<__m256i*>(col[j] + 8 * v), sym);
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + 8 * v), X[v]);
  *rp_io = rp;
  for (int k = 0; k < fmt::kLanes; ++k)
    for (int j = 0; j < fmt::kLaneRun; ++j) syms[fmt::kLaneRun * k + j] = static_cast<uint8_t>(col[j][k]);
  return true;
}

// Encodes one full 256-symbol row of a v3 block (rans_encode_rows, scalar in
// cpu_codec.h): columns 0 .. 7, lane vectors 0 .. 3, the words of a step's
// renormalizing lanes stored in lane order at w. cols: the row column by
// column (lane k's symbol of column j at 32j + k); enc: per symbol, freq |
// cum << 13 | shift << 25 and the magic (rans::DivMagic; shift 31: freq 1).
// Returns the words written. The caller leaves room for 256 words plus 16
// bytes (each vector stores 16).
PZ_TARGET_AVX2 inline uint32_t encode_row(uint32_t* xs, const uint8_t* cols, const uint32_t* enc, uint8_t* w) {
  const LaneRanks& lr = lane_ranks();
  __m256i X[4];
  for (int v = 0; v < 4; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 8 * v));
  const __m256i low16 = _mm256_set1_epi32(0xffff), f_bits = _mm256_set1_epi32(0x1fff);
  const __m256i c_bits = _mm256_set1_epi32(0xfff), s_bits = _mm256_set1_epi32(31), one = _mm256_set1_epi32(1);
  const int* tab = reinterpret_cast<const int*>(enc);
  uint8_t* const w0 = w;
  for (int j = 0; j < fmt::kLaneRun; ++j) {
    for (int v = 0; v < 4; ++v) {
      const __m256i sym = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cols + 32 * j + 8 * v)));
      const __m256i e = _mm256_i32gather_epi32(tab, sym, 8), mag = _mm256_i32gather_epi32(tab + 1, sym, 8);
      const __m256i freq = _mm256_and_si256(e, f_bits);
      const __m256i cum = _mm256_and_si256(_mm256_srli_epi32(e, 13), c_bits);
      const __m256i shift = _mm256_and_si256(_mm256_srli_epi32(e, 25), s_bits);
      const __m256i x = X[v];
      // rans::enc_renorm_needed: x >= freq << 20, i.e. (x >> 20) >= freq (freq <= 4096).
      const __m256i need = _mm256_cmpgt_epi32(_mm256_srli_epi32(x, 32 - fmt::kProbBits), _mm256_sub_epi32(freq, one));
      const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
      // The low halves of the renormalizing lanes, packed in lane order.
      const __m256i lows = _mm256_and_si256(
          _mm256_permutevar8x32_epi32(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(lr.select[m]))), low16);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lows, _mm256_setzero_si256()), 0xd8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm256_castsi256_si128(packed));
      w += 2 * _mm_popcnt_u32(m);
      const __m256i xr = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), need);
      // rans::enc_put_magic: q = xr / freq by the magic multiply (shift 31: freq 1, q = xr).
      const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(xr, mag), 32);
      const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xr, 32), _mm256_srli_epi64(mag, 32));
      const __m256i t = _mm256_blend_epi32(even, odd, 0xaa);
      __m256i q = _mm256_srlv_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(_mm256_sub_epi32(xr, t), 1)), shift);
      q = _mm256_blendv_epi8(q, xr, _mm256_cmpeq_epi32(shift, s_bits));
      X[v] = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q, fmt::kProbBits),
                                               _mm256_sub_epi32(xr, _mm256_mullo_epi32(q, freq))), cum);
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + 8 * v), X[v]);
  return static_cast<uint32_t>(w - w0) / 2;
}

#endif

}  // namespace pz::cpu::simd
