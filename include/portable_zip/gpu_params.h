// What the GPU kernels and their host launcher share: launch parameters,
// CTA shape and shared-memory sizes. Plain C++: the launcher is host code
// that loads the kernels at run time (kernels/gpu_launch.cpp).
#pragma once
#include <stdint.h>

#include "block.h"

namespace pz::gpu {

constexpr int kGroupsPerCta = 2;
constexpr int kCtaThreads = kGroupsPerCta * fmt::kLanes;
static_assert(kCtaThreads % PZ_MAX_WARP_SIZE == 0, "a CTA must fill whole wave64s");

// One tensor to compress.
struct CompressParams {
  const uint8_t* in;
  uint8_t* out;
  uint64_t* status;   // one look-back word per ticket of this tensor, zeroed
  fmt::Header h;
  uint8_t header[fmt::kMaxHeaderBytes + fmt::kAlign];  // pre-serialized, total left 0
};

// One launch compresses one tensor (`one`) or a batch of same-dtype tensors
// (`jobs`, in device memory): CTA tickets run over the tensors' blocks in
// order, ticket_end[j] being the first ticket after tensor j.
struct CompressLaunch {
  CompressParams one;
  const CompressParams* jobs;
  const uint64_t* ticket_end;
  uint32_t njobs;
  uint32_t* ticket;   // zeroed; hands out CTA tickets in launch order
  uint8_t* spill;     // rANS: kSpillBytes per group of each CTA of the grid (the launcher sizes both)
};
static_assert(sizeof(CompressParams) % 8 == 0, "staged into shared memory in 4-byte words");

struct DecompressParams {
  const uint8_t* in;
  uint8_t* out;
  uint32_t* err;
  fmt::Header h;
};

// One decode whose header the kernel parses (no host sync): the launcher
// knows only what the output says (dtype, shape: `expect`) and the work
// (blocks, or raw chunks) a stream of that tensor from this encoder has.
struct DeviceDecode {
  const uint8_t* in;
  uint64_t in_len;
  uint8_t* out;
  uint32_t* err;    // DecodeError bits are OR-ed in (a header's: kErrHeader, kErrMismatch)
  uint64_t work;    // the most blocks (or raw chunks) this encoder writes for the output; a stream with
                    // more is decoded by one ticket
  uint64_t* fast_total;  // with a DecompressLaunch queued after this launch: where the job's first ticket writes
                         // the stream's total if it is as expected (the fast kernel decodes it), else 0
  fmt::Header expect;
};

// A decode whose header the host knows (p.h), the launch of every
// pz_decompress kernel. total: null when the host parsed the stream, else
// the fast path of one device-parsed decode, queued after the general
// kernel has parsed the header: p.h is then the stream this encoder writes
// for the output (plan_header: version, codec, block size), and *total the
// stream's total if it is that stream, else 0 (the general kernel decoded
// or rejected it). By value, so the decode loop reads its parameters from
// the launch (from shared memory, or with the parse in the same kernel,
// they cost 10-30% more registers, and occupancy with them).
struct DecompressLaunch {
  DecompressParams p;
  const uint64_t* total;
};

// One launch decodes one stream (`one`) or a batch (`jobs`, in device memory,
// ticket_end[j] the first ticket after job j). A ticket is up to
// kGroupsPerCta blocks or chunks of one job; CTAs stride over the tickets.
struct DeviceDecodeLaunch {
  DeviceDecode one;
  const DeviceDecode* jobs;
  const uint64_t* ticket_end;
  uint64_t tickets;
  uint32_t njobs;
};
PZ_HOST_DEVICE inline bool same_plan(const fmt::Header& a, const fmt::Header& b) {
  bool same = a.version == b.version && a.dtype == b.dtype && a.codec == b.codec && a.ndim == b.ndim &&
              a.numel == b.numel && a.block_log2 == b.block_log2 && a.lanes == b.lanes;
  for (int d = 0; d < a.ndim && d < fmt::kMaxDims; ++d) same = same && a.shape[d] == b.shape[d];
  return same;
}
static_assert(sizeof(DeviceDecode) % 8 == 0, "staged into shared memory in 4-byte words");

PZ_HOST_DEVICE constexpr uint64_t raw_chunks(const fmt::Layout& l) {
  return (l.raw_end - l.raw_begin + (1ull << fmt::kRawChunkLog2) - 1) >> fmt::kRawChunkLog2;
}

// A stream stored raw (codec 0). Encode: in is the tensor, out the stream,
// header its serialized bytes through raw_begin. Decode: in is the stream.
struct RawParams {
  const uint8_t* in;
  uint8_t* out;
  uint32_t* err;
  fmt::Header h;
  uint8_t header[fmt::kMaxHeaderBytes + fmt::kAlign];
};

// Shared memory per group for compress, laid out once here. The encode table
// (whose first 1 KB holds the merged counts until the table is built),
// frequency scratch (the fixed code's symbol -> code map), then an 8 KB
// (64 lanes: 11 KB) staging buffer for the block's segment. A rANS segment past 8 KB (fp16 and
// e4m3 blocks are ~10 KB) spills its later words to the group's slot of a
// global buffer (kSpillBytes per group, L2-resident), copied out after the
// look-back. Stored blocks are split again from the input at copy-out; a
// fixed-code body that does not fit is encoded straight into place. A small
// buffer buys occupancy: 20 warps per SM instead of 10.
//
// Pass 1 counts into 16 histograms of 16-bit pairs laid out [word][lane & 15]:
// a lane shares its histogram only with lane ^ 16, and lanes hitting one bank
// are at most two (skewed data sends most lanes to one symbol). They live in
// the staging buffer: dead before the table bytes or a coded word land there.
constexpr uint32_t kHistReplicas = 16;
constexpr uint64_t kHistBytes = 128 * kHistReplicas * 4;
constexpr uint64_t kMaxTableBytes = 1 + 32 + 2 * 256;
constexpr uint32_t kStagingBytes = 8192;
// The aligned single-tensor 64-lane kernel stages 11 KB (a bf16 2^15-symbol segment
// is ~10.7 KB): its registers allow 8 CTAs per SM, which 2 x 13.75 KB of
// shared memory per CTA still does, so the bigger buffer costs no occupancy.
constexpr uint32_t kWideStagingBytes = 11264;
static_assert(kHistBytes <= kStagingBytes, "histograms alias the staging buffer");
// A segment past 1 + 2^15 bytes is stored, found at the end of a row: its
// words can pass that limit by one row's worth (a word a symbol) before the
// test. A slot is ~25 KB: the launcher gives one to each CTA the device holds
// at once, not to each ticket (H200: 1,320 CTAs, 68 MB at most).
constexpr uint32_t kSpillBytes =
    (((1u << fmt::kEncoderMaxBlockLog2) + 1 - kStagingBytes + 2 * fmt::kMaxRowSymbols + 2) + 15) & ~15u;
constexpr uint32_t kSpillCtas = 4096;  // a cap on the compress grid whatever the device, so spill slots are bounded
template <uint32_t kStage>
struct alignas(16) CompressSmem {
  static constexpr uint32_t kStaging = kStage;
  union {
    uint32_t enc[256][2];  // rANS encode table: rans::enc_entry
    uint32_t counts[256];  // the block's merged histogram, until enc is built
  };
  union {
    uint16_t freq[256];  // rANS: the quantized frequencies
    uint8_t code[256];   // fixed code: symbol -> code
  };
  union {
    uint8_t staging[kStage];          // the block's segment (16-byte aligned: copied out as vectors)
    uint32_t hist[kHistBytes / 4];    // pass 1: [128 words][kHistReplicas]
  };
};
static_assert(sizeof(CompressSmem<kStagingBytes>) == 256 * 8 + 256 * 2 + kStagingBytes &&
                  sizeof(CompressSmem<kWideStagingBytes>) == 256 * 8 + 256 * 2 + kWideStagingBytes,
              "no padding between the parts");
// rANS states a lane of the compress kernel for a tensor (gpu_kernels.cu):
// 1 or 2 (32 or 64 lanes) for an aligned single tensor; 0, each tensor's
// header choosing, for batches and unaligned inputs (rarer paths, not worth
// a kernel per lane count). The aligned 64-lane kernel stages more.
PZ_HOST_DEVICE constexpr int compress_states(int lanes, bool aligned, bool batched) {
  return batched || !aligned ? 0 : lanes / fmt::kLanes;
}
PZ_HOST_DEVICE constexpr uint32_t compress_staging(int states) {
  return states == 2 ? kWideStagingBytes : kStagingBytes;
}
PZ_HOST_DEVICE constexpr uint64_t compress_smem_per_group(int states) {
  return states == 2 ? sizeof(CompressSmem<kWideStagingBytes>) : sizeof(CompressSmem<kStagingBytes>);
}

// Shared memory per group for the rANS decoder (the fixed code needs none).
// The 32-lane kernel (one state a lane) also stages its block's coded words
// in a ring (kWordRing words a group, after every group's DecompressSmem):
// a shared load on the renormalization chain instead of a global one. The
// 64-lane kernel keeps global loads (a window there measured slower at >=
// 256 MiB, where it is issue-bound: bench/NOTES.md).
struct alignas(16) DecompressSmem {
  uint32_t encsym[256];             // freq | cum << 16
  uint16_t freq[256];               // the parsed table
  uint8_t lookup[fmt::kProbScale];  // slot -> symbol
  int32_t table_bytes;              // lane 0's parse of the table, for the group
};
constexpr uint64_t kDecompressSmemPerGroup = sizeof(DecompressSmem);
// Words in a group's ring: a power of two, and at least the 192 words a row
// of 256 symbols can take (6 a lane: a state starts a row with at least 17
// bits and ends it with at most 32, a step takes at most 12, a word adds 16)
// plus the row ahead's loads.
constexpr uint32_t kWordRing = 512;
// Whether the decompress kernel of codec C and S states a lane stages its
// words in a ring: the rANS kernel of one state a lane.
template <fmt::Codec C, int S>
constexpr bool kRingKernel = C == fmt::Codec::Rans && S == 1;
// The rANS decompress kernel's shared memory per group for a stream of
// `lanes` lanes, by the same test that names its kernel (kernel_names.h:
// 64 lanes or not).
PZ_HOST_DEVICE constexpr uint64_t decompress_smem_per_group(int lanes) {
  return sizeof(DecompressSmem) + (lanes == fmt::kWideLanes ? 0 : kWordRing * 2);
}

}  // namespace pz::gpu
