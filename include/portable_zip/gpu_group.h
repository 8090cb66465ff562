// Device code shared by the compress and decompress kernels: group-wide
// (32-lane) reductions and scans, and how a block's symbols map onto lanes
// and 16-byte chunks. One 32-lane group owns one block; a CTA holds
// kGroupsPerCta groups (one wave64 on CDNA, two warps elsewhere).
#pragma once
#include <stdint.h>

#include "block.h"
#include "gpu_params.h"

namespace pz::gpu {

// Bytes of input per symbol, and symbols per 16-byte-aligned vector chunk.
template <fmt::DType D>
constexpr int kSymBytes = D == fmt::DType::Float32 ? 4 : 2;
constexpr int kChunkSyms = 8;

// Compile-time values passed to generic lambdas.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};
template <int N>
struct Int {
  static constexpr int value = N;
};

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

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz::gpu
