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

namespace pz::gpu {

constexpr int kGroupsPerCta = 2;
constexpr int kCtaThreads = kGroupsPerCta * fmt::kLanes;
static_assert(kCtaThreads % PZ_MAX_WARP_SIZE == 0, "a CTA must fill whole wave64s");

struct CompressParams {
  const uint8_t* in;
  uint8_t* out;
  uint64_t* status;   // one look-back word per CTA, zeroed
  uint32_t* ticket;   // zeroed; hands out CTA tickets in launch order
  fmt::Header h;
  uint8_t header[fmt::kMaxHeaderBytes + fmt::kAlign];  // pre-serialized, total left 0
};

struct DecompressParams {
  const uint8_t* in;
  uint8_t* out;
  uint32_t* err;
  fmt::Header h;
};

// Shared memory per group for compress: 8 replicated 16-bit-pair histograms
// (lane & 7: skewed data sends most lanes to one bin, and replicas cut the
// atomic conflicts 8x), merged counts, the encode table, frequency scratch,
// then the segment staging buffer.
constexpr uint64_t kHistReplicas = 8;
constexpr uint64_t kCompressTableBytes = kHistReplicas * 128 * 4 + 256 * 4 + 256 * 8 + 256 * 2;
PZ_HOST_DEVICE constexpr uint64_t compress_smem_per_group(int block_log2) {
  return kCompressTableBytes + fmt::align_up(1 + (1ull << block_log2), fmt::kAlign);
}
constexpr uint64_t kDecompressSmemPerGroup = 4 * 256 + 2 * 256 + fmt::kProbScale + 16;

// Bytes of input per symbol, and symbols per 16-byte-aligned vector chunk.
template <fmt::DType D>
constexpr int kSymBytes = D == fmt::DType::Float32 ? 4 : 2;
constexpr int kChunkSyms = 8;

#if defined(PZ_CUDA) || defined(PZ_HIP)

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
PZ_DEVICE PZ_FORCE_INLINE Chunk<D> load_chunk(const uint8_t* in, uint64_t sym_index) {
  using T = FloatTraits<D>;
  union {
    uint4 v[kSymBytes<D> / 2];
    uint8_t b[8 * kSymBytes<D>];
  } u;
  const uint4* src = reinterpret_cast<const uint4*>(in + sym_index * kSymBytes<D>);
#pragma unroll
  for (int k = 0; k < kSymBytes<D> / 2; ++k) u.v[k] = src[k];
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

template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE bool chunk_in_range(const fmt::Header& h, uint64_t first, uint32_t i, uint32_t n) {
  constexpr uint64_t E = (D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2) ? 2 : 1;
  return i + kChunkSyms <= n && (first + i + kChunkSyms) * E <= h.numel;
}

// Encodes block b into the group's staging buffer (split, histogram, table,
// rANS, stored fallback) and writes its raw planes. Returns the padded size.
template <fmt::DType D, bool Aligned>
PZ_DEVICE uint64_t encode_block(const CompressParams& p, const fmt::Layout& l, uint64_t b, uint8_t* base) {
  using T = FloatTraits<D>;
  constexpr bool plane16 = fmt::has_plane16(D);
  const fmt::Header& h = p.h;
  const int lane = group_lane();
  uint32_t* hist = reinterpret_cast<uint32_t*>(base);            // [8][128] u16 pairs
  uint32_t* counts = hist + kHistReplicas * 128;                  // [256]
  uint2* enc = reinterpret_cast<uint2*>(counts + 256);            // [256]
  uint16_t* freq = reinterpret_cast<uint16_t*>(enc + 256);        // [256]
  uint8_t* buf = reinterpret_cast<uint8_t*>(freq + 256);
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);

  // Pass 1: split, histogram, raw planes. Block counts stay below 2^16, so
  // two 16-bit counters share a word.
  for (uint32_t i = lane; i < kHistReplicas * 128; i += fmt::kLanes) hist[i] = 0;
  group_sync();
  uint32_t* my_hist = hist + (lane & (kHistReplicas - 1)) * 128;
  auto count = [&](uint32_t sym) { atomic_add<Scope::Block>(&my_hist[sym >> 1], 1u << (16 * (sym & 1))); };
  uint32_t scalar_from = 0;
  if (Aligned) {
    scalar_from = n;
    for (uint32_t i = lane * kChunkSyms;; i += fmt::kLanes * kChunkSyms) {
      const uint32_t chunk0 = i - lane * kChunkSyms;  // group-uniform chunk row start
      if (!chunk_in_range<D>(h, first, chunk0 + (fmt::kLanes - 1) * kChunkSyms, n)) {
        scalar_from = chunk0;  // the rest (partial row) goes scalar
        break;
      }
      const Chunk<D> c = load_chunk<D>(p.in, first + i);
#pragma unroll
      for (int k = 0; k < kChunkSyms; ++k) count((c.sym[k >> 2] >> (8 * (k & 3))) & 0xff);
      *reinterpret_cast<uint2*>(p.out + l.raw_begin + first + i) = make_uint2(c.raw8[0], c.raw8[1]);
      if (plane16)
        *reinterpret_cast<uint4*>(p.out + l.plane16_begin + 2 * (first + i)) =
            make_uint4(c.raw16[0], c.raw16[1], c.raw16[2], c.raw16[3]);
    }
  }
  for (uint32_t i = scalar_from + lane; i < n; i += fmt::kLanes) {
    const Split sp = T::split(p.in, first + i, h.numel);
    count(sp.sym);
    write_raw(p.out, l, plane16, first + i, sp);
  }
  group_sync();
  for (int s = lane; s < 256; s += fmt::kLanes) {
    uint32_t c = 0;
    for (uint32_t r = 0; r < kHistReplicas; ++r) c += (hist[r * 128 + (s >> 1)] >> (16 * (s & 1))) & 0xffff;
    counts[s] = c;
  }
  group_sync();
  if (lane == 0) {
    rans::quantize(counts, n, freq);
    counts[0] = static_cast<uint32_t>(rans::write_table(freq, buf + 1));  // counts are free now
    uint32_t cum = 0;
    for (int s = 0; s < 256; ++s) {
      hist[s] = cum;  // hist is free too: cumulative frequencies
      cum += freq[s];
    }
  }
  group_sync();
  for (int s = lane; s < 256; s += fmt::kLanes) {
    const rans::DivMagic d = rans::div_magic(freq[s]);
    enc[s] = make_uint2(freq[s] | (hist[s] << 13) | (d.shift << 25), d.magic);
  }
  const int table_bytes = static_cast<int>(counts[0]);
  group_sync();

  // Pass 2: interleaved rANS, 8 steps per 256-symbol row. A row is loaded as
  // one 8-symbol chunk per lane and redistributed with shuffles, so lane L
  // gets symbol row + 32k + L at step k.
  const uint32_t prefix = rans::rans_prefix_bytes(table_bytes);
  const uint64_t limit = 1ull + n;
  bool stored = prefix >= limit;
  uint32_t x = fmt::kStateLow;
  uint32_t words = 0;
  uint16_t* wbuf = reinterpret_cast<uint16_t*>(buf + prefix);  // prefix is even
  for (uint32_t row = 0; row < n && !stored; row += fmt::kLanes * kChunkSyms) {
    uint32_t lo = 0, hi = 0;
    const uint32_t mine = row + lane * kChunkSyms;
    if (Aligned && chunk_in_range<D>(h, first, mine, n)) {
      const Chunk<D> c = load_chunk<D>(p.in, first + mine);
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
      if (stored) continue;  // group-uniform; no break, so the loop unrolls
      const uint32_t idx = row + k * fmt::kLanes + lane;
      const int src = k * (fmt::kLanes / kChunkSyms) + (lane >> 3);
      const uint32_t wlo = group_shfl(lo, src), whi = group_shfl(hi, src);
      const uint32_t sym = (((lane & 7) < 4 ? wlo : whi) >> (8 * (lane & 3))) & 0xff;
      const bool valid = idx < n;
      const uint2 e = enc[sym];
      const uint32_t f = e.x & 0x1fff;
      const bool need = valid && rans::enc_renorm_needed(x, f);
      const uint32_t ballot = group_ballot(need);
      const uint32_t cnt = popc32(ballot);
      if (prefix + 2ull * (words + cnt) >= limit) {
        stored = true;  // every lane saw the same words/cnt
        continue;
      }
      if (need) {
        wbuf[words + popc32(ballot & group_lanemask_lt())] = static_cast<uint16_t>(x);
        x >>= 16;
      }
      words += cnt;
      if (valid) x = rans::enc_put_magic(x, f, (e.x >> 13) & 0xfff, rans::DivMagic{e.y, e.x >> 25});
    }
  }
  group_sync();  // the table bytes (lane 0) are overwritten below in stored mode
  uint64_t used;
  if (stored) {
    if (lane == 0) buf[0] = fmt::kModeStored;
    for (uint32_t i = lane; i < n; i += fmt::kLanes) buf[1 + i] = T::split(p.in, first + i, h.numel).sym;
    used = 1ull + n;
  } else {
    const uint32_t wpos = static_cast<uint32_t>(fmt::align_up(1 + table_bytes, 4));
    if (lane == 0) {
      buf[0] = fmt::kModeRans;
      for (uint32_t i = 1 + table_bytes; i < wpos; ++i) buf[i] = 0;
      put_u32(buf + wpos, words);
    }
    reinterpret_cast<uint32_t*>(buf + wpos + 4)[lane] = x;
    used = prefix + 2ull * words;
  }
  const uint64_t padded = fmt::align_up(used, fmt::kAlign);
  for (uint64_t i = used + lane; i < padded; i += fmt::kLanes) buf[i] = 0;
  group_sync();
  return padded;
}

// One CTA takes a ticket and encodes blocks ticket*kGroupsPerCta + group. The
// look-back runs per CTA, by group 0 only: on wave64 both groups share one
// wave, so no group may spin on a result its wave-mate has yet to produce.
template <fmt::DType D, bool Aligned>
PZ_GLOBAL void __launch_bounds__(kCtaThreads) compress_kernel(CompressParams p) {
  constexpr bool plane16 = fmt::has_plane16(D);
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint32_t cta_ticket;
  __shared__ uint64_t cta_size[kGroupsPerCta];
  __shared__ uint64_t cta_excl;
  const fmt::Header& h = p.h;
  const fmt::Layout l = fmt::layout_of(h);
  const int lane = group_lane();
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  uint8_t* base = smem + group * compress_smem_per_group(h.block_log2);
  uint8_t* buf = base + kCompressTableBytes;

  if (threadIdx.x == 0) cta_ticket = atomic_add<Scope::Device>(p.ticket, 1u);
  __syncthreads();
  const uint64_t ticket = cta_ticket;
  const uint64_t b = ticket * kGroupsPerCta + group;
  const bool active = b < l.nblocks;
  const uint64_t padded = active ? encode_block<D, Aligned>(p, l, b, base) : 0;
  if (lane == 0) cta_size[group] = padded;
  __syncthreads();
  if (group == 0) {
    uint64_t agg = 0;
    for (int g = 0; g < kGroupsPerCta; ++g) agg += cta_size[g];
    const uint64_t excl = lookback(p.status, ticket, agg);
    if (lane == 0) cta_excl = excl;
  }
  __syncthreads();
  if (!active) return;
  uint64_t excl = cta_excl;
  for (int g = 0; g < group; ++g) excl += cta_size[g];

  uint8_t* dst = p.out + l.coded_begin + excl;
  for (uint64_t i = lane; i < padded / 16; i += fmt::kLanes)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(buf)[i];
  if (lane == 0) *reinterpret_cast<uint64_t*>(p.out + l.offsets_begin + 8 * b) = excl + padded;
  if (b == 0) {
    // Header (minus the total, which the last block owns) and the zero gaps.
    for (uint64_t i = lane; i < l.raw_begin; i += fmt::kLanes)
      if (i < 8 || i >= 16) p.out[i] = p.header[i];
    for (uint64_t i = l.raw_begin + l.nsym + lane; i < l.plane16_begin && plane16; i += fmt::kLanes) p.out[i] = 0;
    for (uint64_t i = l.raw_end + lane; i < l.offsets_begin; i += fmt::kLanes) p.out[i] = 0;
    for (uint64_t i = l.offsets_begin + 8 * l.nblocks + lane; i < l.coded_begin; i += fmt::kLanes) p.out[i] = 0;
  }
  if (b + 1 == l.nblocks && lane == 0) {
    const uint64_t total = l.coded_begin + excl + padded;
    for (int i = 0; i < 8; ++i) p.out[8 + i] = static_cast<uint8_t>(total >> (8 * i));
  }
}

// Writes symbol i's element(s) with one store of the element's width (the
// output tensor is aligned to its dtype); fp8 pairs go byte by byte.
template <fmt::DType D>
PZ_DEVICE PZ_FORCE_INLINE void store_element(uint8_t* out, uint64_t i, uint64_t numel, uint8_t sym, uint8_t raw8,
                                             uint16_t raw16) {
  using T = FloatTraits<D>;
  if constexpr (D == fmt::DType::Float32) {
    uint8_t b[4];
    T::join(b, 0, 1, sym, raw8, raw16);
    reinterpret_cast<uint32_t*>(out)[i] = b[0] | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
  } else if constexpr (D == fmt::DType::BFloat16 || D == fmt::DType::Float16) {
    uint8_t b[2];
    T::join(b, 0, 1, sym, raw8, raw16);
    reinterpret_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(b[0] | (b[1] << 8));
  } else {
    T::join(out, i, numel, sym, raw8, raw16);
  }
}

template <fmt::DType D>
PZ_GLOBAL void __launch_bounds__(kCtaThreads) decompress_kernel(DecompressParams p) {
  using T = FloatTraits<D>;
  constexpr bool plane16 = fmt::has_plane16(D);
  extern __shared__ __align__(16) uint8_t smem[];
  const fmt::Header& h = p.h;
  const fmt::Layout l = fmt::layout_of(h);
  const int lane = group_lane();
  const int group = static_cast<int>(threadIdx.x) / fmt::kLanes;
  const uint64_t b = static_cast<uint64_t>(blockIdx.x) * kGroupsPerCta + group;
  if (b >= l.nblocks) return;
  uint8_t* base = smem + group * kDecompressSmemPerGroup;
  uint32_t* encsym = reinterpret_cast<uint32_t*>(base);
  uint16_t* freq = reinterpret_cast<uint16_t*>(encsym + 256);
  uint8_t* lookup = reinterpret_cast<uint8_t*>(freq + 256);
  int32_t* shared_tb = reinterpret_cast<int32_t*>(lookup + fmt::kProbScale);

  uint64_t sb, se;
  if (!segment_bounds(p.in, h, l, b, &sb, &se)) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrOffsets);
    return;
  }
  const uint8_t* seg = p.in + l.coded_begin + sb;
  const uint64_t seglen = se - sb;
  const uint64_t first = b << h.block_log2;
  const uint32_t n = fmt::block_symbols(h, l, b);
  const uint8_t* raw8 = p.in + l.raw_begin;
  if (seg[0] == fmt::kModeStored) {
    if (seglen < 1ull + n) {
      if (lane == 0) atomic_or<Scope::Device>(p.err, kErrSegment);
      return;
    }
    for (uint32_t i = lane; i < n; i += fmt::kLanes)
      store_element<D>(p.out, first + i, h.numel, seg[1 + i], raw8[first + i], raw16_at(p.in, l, plane16, first + i));
    return;
  }
  if (seg[0] != fmt::kModeRans) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrSegment);
    return;
  }
  if (lane == 0) {
    const int tb = rans::parse_table(seg + 1, seg + seglen, freq);
    if (tb >= 0) build_encsym(freq, encsym);
    *shared_tb = tb;
  }
  group_sync();
  const int table_bytes = *shared_tb;
  if (table_bytes < 0) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrTable);
    return;
  }
  for (int s = lane; s < 256; s += fmt::kLanes) {
    const uint32_t c = encsym[s] >> 16, f = encsym[s] & 0xffff;
    for (uint32_t k = 0; k < f; ++k) lookup[c + k] = static_cast<uint8_t>(s);
  }
  const uint64_t wpos = fmt::align_up(1 + table_bytes, 4);
  const uint64_t prefix = rans::rans_prefix_bytes(table_bytes);
  const uint64_t words = prefix <= seglen ? get_u32(seg + wpos) : 0;
  if (prefix > seglen || prefix + 2 * words > seglen) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrSegment);
    return;
  }
  uint32_t x = get_u32(seg + wpos + 4 + 4 * lane);
  if (group_ballot(x < fmt::kStateLow)) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrStream);
    return;
  }
  group_sync();  // lookup complete
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(seg + prefix);  // the launcher checks 16B alignment
  uint64_t rp = words;
  const uint32_t steps = (n + fmt::kLanes - 1) / fmt::kLanes;
  bool ok = true;
  for (uint32_t s = steps; s-- > 0;) {
    const uint32_t idx = s * fmt::kLanes + lane;
    const bool valid = idx < n;
    if (valid) {
      const uint8_t sym = lookup[x & (fmt::kProbScale - 1)];
      const uint32_t es = encsym[sym];
      x = rans::dec_step(x, es & 0xffff, es >> 16);
      store_element<D>(p.out, first + idx, h.numel, sym, raw8[first + idx], raw16_at(p.in, l, plane16, first + idx));
    }
    const bool need = valid && x < fmt::kStateLow;
    const uint32_t ballot = group_ballot(need);
    const uint32_t count = popc32(ballot);
    if (count > rp) {
      ok = false;  // group-uniform
      break;
    }
    if (need) {
      const uint64_t r = rp - count + popc32(ballot & group_lanemask_lt());
      x = (x << 16) | wp[r];
    }
    rp -= count;
  }
  if (!ok || rp != 0 || group_ballot(x != fmt::kStateLow)) {
    if (lane == 0) atomic_or<Scope::Device>(p.err, kErrStream);
  }
}

#endif

}  // namespace pz::gpu
