// GPU kernels of the weight-delta codec (delta.h). Encode: a 32-lane group
// per block counts and sizes it (plan), one CTA scans the sizes into offsets
// (table), and a group per block writes its codes at prefix-summed bit
// offsets (write), so the bytes are the CPU encoder's. Decode: the table
// kernel checks the stream's table, then a group per block runs delta.h's
// decode_block, once dry and once writing. Checksums: grid-wide sums.
#pragma once
#include <stdint.h>

#include "delta.h"
#include "gpu_group.h"

namespace pz::gpu {

// Error bits of a GPU apply (delta_verdict reads them).
constexpr uint32_t kDeltaErrTable = 1;
constexpr uint32_t kDeltaErrBlock = 2;

struct DeltaSumParams {
  const uint8_t* p;
  uint64_t nbytes;
  uint32_t* sums;  // lo, hi: added to
};

// Plan / write / decode of one tensor. ws: u64 offsets[nblocks + 1],
// u64 changed, u64 entries[nblocks] (the plan's table, delta.h layout).
struct DeltaParams {
  const uint8_t* base;
  const uint8_t* target;  // encode
  uint8_t* out;           // write: the stream; decode: the base, rewritten
  const uint8_t* stream;  // decode
  uint64_t numel, nblocks, total;
  uint64_t* ws;
  uint32_t* err;
  int log2, w;
  bool write;  // decode: apply the changes (else a dry run)
};

struct DeltaTableParams {
  const uint8_t* entries;  // nblocks entries of 8 bytes
  uint64_t numel, nblocks;
  uint64_t* ws;  // offsets and changed, as DeltaParams
  uint32_t* err;
  uint64_t expect_total, expect_changed;  // apply: the header's; encode: unchecked
  int log2, w;
  bool check;
};

PZ_HOST_DEVICE PZ_FORCE_INLINE uint64_t* delta_entries(uint64_t* ws, uint64_t nblocks) { return ws + nblocks + 2; }

#if defined(PZ_CUDA) || defined(PZ_HIP)

PZ_DEVICE PZ_FORCE_INLINE int highest_bit(uint32_t m) {  // m != 0
  m |= m >> 1, m |= m >> 2, m |= m >> 4, m |= m >> 8, m |= m >> 16;
  return popc32(m) - 1;
}

PZ_DEVICE PZ_FORCE_INLINE uint32_t group_max32(uint32_t v) {
#pragma unroll
  for (int m = 1; m < fmt::kLanes; m <<= 1) {
    const uint32_t o = group_shfl_xor(v, m);
    v = o > v ? o : v;
  }
  return v;
}

// Group index and count over the grid (kGroupsPerCta groups a CTA).
PZ_DEVICE PZ_FORCE_INLINE uint64_t group_id() {
  return static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + threadIdx.x / fmt::kLanes;
}
PZ_DEVICE PZ_FORCE_INLINE uint64_t group_count() { return static_cast<uint64_t>(gridDim.x) * kGroupsPerCta; }

PZ_DEVICE inline void delta_checksum_kernel(const DeltaSumParams& p) {
  const uint64_t units = (p.nbytes + 3) / 4, full = p.nbytes / 4;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const bool aligned = reinterpret_cast<uintptr_t>(p.p) % 4 == 0;
  uint32_t lo = 0, hi = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += stride) {
    const uint32_t u = aligned && i < full ? reinterpret_cast<const uint32_t*>(p.p)[i] : delta::tail_unit(p.p, p.nbytes, i);
    const uint32_t ix = delta::unit_index(i);
    lo += delta::term_lo(u, ix);
    hi += delta::term_hi(u, ix);
  }
  lo = group_sum32(lo), hi = group_sum32(hi);
  if (group_lane() == 0) {
    atomic_add<Scope::Device>(p.sums, lo);
    atomic_add<Scope::Device>(p.sums + 1, hi);
  }
}

// Blocks are walked a chunk of 8 elements a lane at a time (lane l holds
// elements c0 + 8l .. c0 + 8l + 7, so lane order is element order): a lane's
// 8 loads are in flight together, and the group agrees once a chunk.
constexpr uint32_t kDeltaPerLane = 8;
constexpr uint32_t kDeltaChunk = kDeltaPerLane * fmt::kLanes;

// This lane's zigzags of chunk c0 (0 past n); returns its first element.
template <class T>
PZ_DEVICE PZ_FORCE_INLINE uint32_t lane_zigzags(const T* b, const T* t, uint32_t c0, uint32_t n, int w,
                                                uint32_t (&z)[kDeltaPerLane]) {
  const uint32_t i0 = c0 + kDeltaPerLane * static_cast<uint32_t>(group_lane());
#pragma unroll
  for (uint32_t j = 0; j < kDeltaPerLane; ++j) z[j] = i0 + j < n ? delta::delta_zigzag(b[i0 + j], t[i0 + j], w) : 0u;
  return i0;
}

// The gap before each of this lane's changes in the chunk (gap[j] where z[j]
// != 0): from the previous change, which may sit in a lower lane or an earlier
// chunk (next: the position after the last change so far; updated).
PZ_DEVICE PZ_FORCE_INLINE void lane_gaps(const uint32_t (&z)[kDeltaPerLane], uint32_t i0, uint32_t& next,
                                         uint32_t (&gap)[kDeltaPerLane]) {
  uint32_t last_end = 0;
#pragma unroll
  for (uint32_t j = 0; j < kDeltaPerLane; ++j) last_end = z[j] ? i0 + j + 1 : last_end;
  const uint32_t mask = group_ballot(last_end != 0);
  const uint32_t below = mask & group_lanemask_lt();
  const uint32_t from_below = group_shfl(last_end, below ? highest_bit(below) : 0);
  uint32_t end = below ? from_below : next;
#pragma unroll
  for (uint32_t j = 0; j < kDeltaPerLane; ++j) {
    gap[j] = i0 + j - end;
    end = z[j] ? i0 + j + 1 : end;
  }
  if (mask) next = group_shfl(last_end, highest_bit(mask));
}

// One chunk of a block for plan and write: this lane's zigzags and gaps, and
// the bits its changes' codes take.
template <class T>
PZ_DEVICE PZ_FORCE_INLINE uint32_t lane_chunk(const T* b, const T* t, uint32_t c0, uint32_t n, const delta::Entry& e,
                                              int log2, int w, uint32_t& next, uint32_t (&z)[kDeltaPerLane],
                                              uint32_t (&gap)[kDeltaPerLane]) {
  lane_gaps(z, lane_zigzags(b, t, c0, n, w, z), next, gap);
  uint32_t bits = 0;
#pragma unroll
  for (uint32_t j = 0; j < kDeltaPerLane; ++j) bits += z[j] ? delta::element_bits(gap[j], z[j], e, log2, w) : 0u;
  return bits;
}

// Plan: a group per block; each block's entry into the workspace, its byte
// count into offsets[b] (the table kernel scans them).
template <class T>
PZ_DEVICE inline void delta_plan_kernel(const DeltaParams& p) {
  const T* base = reinterpret_cast<const T*>(p.base);
  const T* target = reinterpret_cast<const T*>(p.target);
  for (uint64_t b = group_id(); b < p.nblocks; b += group_count()) {
    const T* bb = base + (b << p.log2);
    const T* tb = target + (b << p.log2);
    const uint32_t n = delta::block_elems(p.numel, p.log2, b);
    uint32_t c = 0, last = 0;
    uint64_t sv = 0;
    for (uint32_t c0 = 0; c0 < n; c0 += kDeltaChunk) {
      uint32_t z[kDeltaPerLane];
      const uint32_t i0 = lane_zigzags(bb, tb, c0, n, p.w, z);
#pragma unroll
      for (uint32_t j = 0; j < kDeltaPerLane; ++j)
        if (z[j]) ++c, last = i0 + j, sv += z[j] - 1u;
    }
    c = group_sum32(c), last = group_max32(last), sv = group_sum64(sv);
    delta::Entry e{0, c, 0, 0};
    if (c) {
      e.k_gap = delta::choose_k(last + 1 - c, c, p.log2);
      e.k_value = delta::choose_k(sv, c, p.w);
      uint64_t bits = 0;
      uint32_t next = 0;
      for (uint32_t c0 = 0; c0 < n; c0 += kDeltaChunk) {
        uint32_t z[kDeltaPerLane], gap[kDeltaPerLane];
        bits += group_sum32(lane_chunk(bb, tb, c0, n, e, p.log2, p.w, next, z, gap));
      }
      e.bytes = static_cast<uint32_t>(4 * ((bits + 31) / 32));
    }
    if (group_lane() == 0) {
      uint8_t entry[delta::kEntryBytes];
      delta::put_entry(entry, e);
      delta_entries(p.ws, p.nblocks)[b] = fmt::get_u64(entry);
      p.ws[b] = e.bytes;
    }
  }
}

// One CTA: the entries' byte counts scanned into payload offsets
// (offsets[nblocks] = the total), their counts summed; with check, each entry
// validated and the sums compared with the header's (err bits).
PZ_DEVICE inline void delta_table_kernel(const DeltaTableParams& p) {
  __shared__ uint64_t part_bytes[kCtaThreads], part_count[kCtaThreads];
  const uint64_t per = (p.nblocks + kCtaThreads - 1) / kCtaThreads;
  const uint64_t a = threadIdx.x * per < p.nblocks ? threadIdx.x * per : p.nblocks;
  const uint64_t z = a + per < p.nblocks ? a + per : p.nblocks;
  uint64_t bytes = 0, count = 0;
  bool bad = false;
  for (uint64_t k = a; k < z; ++k) {
    const delta::Entry e = delta::get_entry(p.entries + delta::kEntryBytes * k);
    if (p.check) bad = bad || !delta::entry_ok(e, delta::block_elems(p.numel, p.log2, k), p.log2, p.w);
    bytes += e.bytes, count += e.count;
  }
  part_bytes[threadIdx.x] = bytes, part_count[threadIdx.x] = count;
  PZ_BLOCK_SYNC();
  uint64_t at = delta::payload_begin(p.nblocks), changed = 0;
  for (int t = 0; t < kCtaThreads; ++t) {
    if (t == static_cast<int>(threadIdx.x)) break;
    at += part_bytes[t];
  }
  for (uint64_t k = a; k < z; ++k) {
    p.ws[k] = at;
    at += delta::get_entry(p.entries + delta::kEntryBytes * k).bytes;
  }
  if (bad) atomic_or<Scope::Device>(p.err, kDeltaErrTable);
  if (threadIdx.x == kCtaThreads - 1) {
    for (int t = 0; t < kCtaThreads; ++t) changed += part_count[t];
    p.ws[p.nblocks] = at;
    p.ws[p.nblocks + 1] = changed;
    if (p.check && (at != p.expect_total || changed != p.expect_changed)) atomic_or<Scope::Device>(p.err, kDeltaErrTable);
  }
}

// Write: a group per block zeroes its words, then ORs each change's codes in
// at its bit offset (delta.h's put_rice: the CPU encoder's bits).
template <class T>
PZ_DEVICE inline void delta_write_kernel(const DeltaParams& p) {
  const T* base = reinterpret_cast<const T*>(p.base);
  const T* target = reinterpret_cast<const T*>(p.target);
  const uint64_t* entries = delta_entries(p.ws, p.nblocks);
  const int lane = group_lane();
  for (uint64_t b = group_id(); b < p.nblocks; b += group_count()) {
    uint8_t raw[delta::kEntryBytes];
    fmt::put_u64(raw, entries[b]);
    const delta::Entry e = delta::get_entry(raw);
    uint32_t* words = reinterpret_cast<uint32_t*>(p.out + p.ws[b]);
    for (uint32_t k = lane; k < e.bytes / 4; k += fmt::kLanes) words[k] = 0;
    if (lane < delta::kEntryBytes) p.out[delta::kHeaderBytes + delta::kEntryBytes * b + lane] = raw[lane];
    group_sync();
    if (!e.count) continue;
    auto or_word = [words](uint64_t k, uint32_t v) { atomic_or<Scope::Device>(words + k, v); };
    const T* bb = base + (b << p.log2);
    const T* tb = target + (b << p.log2);
    const uint32_t n = delta::block_elems(p.numel, p.log2, b);
    uint64_t bit = 0;
    uint32_t next = 0;
    for (uint32_t c0 = 0; c0 < n; c0 += kDeltaChunk) {
      uint32_t z[kDeltaPerLane], gap[kDeltaPerLane];
      const uint32_t lane_bits = lane_chunk(bb, tb, c0, n, e, p.log2, p.w, next, z, gap);
      const uint32_t before = group_exclusive_scan(lane_bits);
      uint64_t at = bit + before;
#pragma unroll
      for (uint32_t j = 0; j < kDeltaPerLane; ++j)
        if (z[j]) {
          at = delta::put_rice(or_word, at, gap[j], e.k_gap, p.log2);
          at = delta::put_rice(or_word, at, z[j] - 1u, e.k_value, p.w);
        }
      bit += group_shfl(before + lane_bits, fmt::kLanes - 1);
    }
  }
}

// Decode: a group per block, after the table kernel (which set err on a bad
// table: then nothing runs). Dry (write false): decode only, err on a bad
// block. Write: apply the changes to the base in place. The group first pulls
// the block's payload into L1 (coalesced), then every lane decodes the same
// bits in step (delta.h's decode_block: uniform within the group, so one load
// serves it; where two groups share a wave64, their blocks' paths serialize
// but no lane waits on another); change i is applied by lane i % 32, 32 at a time,
// so each round of read-modify-writes has 32 loads in flight, not one.
template <class T>
PZ_DEVICE inline void delta_decode_kernel(const DeltaParams& p) {
  if (*reinterpret_cast<volatile uint32_t*>(p.err)) return;
  T* base = reinterpret_cast<T*>(p.out);
  const uint32_t lane = group_lane();
  const int w = p.w;
  for (uint64_t b = group_id(); b < p.nblocks; b += group_count()) {
    const delta::Entry e = delta::get_entry(p.stream + delta::kHeaderBytes + delta::kEntryBytes * b);
    const uint32_t n = delta::block_elems(p.numel, p.log2, b);
    const uint64_t at = p.ws[b];
    if (!delta::entry_ok(e, n, p.log2, w) || at > p.total || e.bytes > p.total - at) {
      if (lane == 0) atomic_or<Scope::Device>(p.err, kDeltaErrTable);
      continue;
    }
    for (uint32_t k = 128 * lane; k < e.bytes; k += 128 * fmt::kLanes) prefetch_l1(p.stream + at + k);
    if (lane == 0 && e.bytes) prefetch_l1(p.stream + at + e.bytes - 1);  // the last line, where at is not aligned
    T* blk = base + (b << p.log2);
    uint32_t i = 0, mine_pos = 0, mine_z = 0;  // this lane's change of the current round of 32
    const bool ok = p.write ? delta::decode_block(p.stream + at, e, n, p.log2, w, [&](uint32_t pos, uint32_t z) {
      if ((i & (fmt::kLanes - 1)) == lane) mine_pos = pos, mine_z = z;
      if ((++i & (fmt::kLanes - 1)) == 0) delta::apply_element(blk, mine_pos, mine_z, w);
    })
                            : delta::decode_block(p.stream + at, e, n, p.log2, w, [](uint32_t, uint32_t) {});
    if (p.write && ok && lane < (i & (fmt::kLanes - 1))) delta::apply_element(blk, mine_pos, mine_z, w);
    if (!ok && lane == 0) atomic_or<Scope::Device>(p.err, kDeltaErrBlock);
  }
}

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz::gpu
