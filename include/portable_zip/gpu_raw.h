// Streams stored raw (codec 0): copied in 64 KiB chunks with one checksum
// each, checked before any byte reaches the output.
#pragma once
#include <stdint.h>

#include "gpu_group.h"

namespace pz::gpu {

#if defined(PZ_CUDA) || defined(PZ_HIP)

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

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz::gpu
