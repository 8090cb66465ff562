// The portable_zip wire format, version 4 (versions 1 to 3 still decode).
// docs/FORMAT.md is the byte-by-byte description; this header is its
// executable form. All integers are little-endian. Nothing here depends on the
// vendor or the warp width.
#pragma once
#include <stdint.h>

#include "intrinsics.h"

namespace pz::fmt {

constexpr uint8_t kMagic[4] = {'P', 'Z', 'I', 'P'};
constexpr uint32_t kMagicWord = 'P' | 'Z' << 8 | 'I' << 16 | static_cast<uint32_t>('P') << 24;  // device code reads this
constexpr uint8_t kVersion = 4;     // what the encoder writes
constexpr uint8_t kMinVersion = 1;  // the oldest the decoder reads (no checksums)
// Version 3: a rANS lane codes runs of kLaneRun consecutive symbols (one
// 16-byte vector of input), and block checksums hash 32-bit words.
constexpr uint8_t kContigVersion = 3;
// Version 4: the header's lane count may be 64 (rANS only): rows of 512
// symbols, so each GPU lane carries two independent states (kWideLanes).
constexpr uint8_t kWideVersion = 4;

// rANS constants. The interleave width is part of the format, not the
// hardware: kLanes, or (v4, rANS) kWideLanes, named in the header.
constexpr int kLanes = 32;
constexpr int kWideLanes = 64;
constexpr int kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kStateLow = 1u << 16;  // L: states live in [L, 2^32)
constexpr int kNumSymbols = 256;
constexpr int kLaneRun = 8;                     // v3: consecutive symbols per lane per row
constexpr int kRowSymbols = kLanes * kLaneRun;  // v3: a row, kLaneRun steps (of a 32-lane stream)
constexpr int kMaxRowSymbols = kWideLanes * kLaneRun;
static_assert(kLanes == kGroupLanes, "group width must equal the format's lane count");

// Blocks hold 2^block_log2 symbols. The decoder accepts the whole range; the
// encoder picks by size alone (choose_block_log2) so every backend agrees.
constexpr int kMinBlockLog2 = 10;
constexpr int kMaxBlockLog2 = 16;
constexpr int kEncoderMaxBlockLog2 = 15;  // bounds the encoder's staging and spill buffers
// From kWideMinSymbols on, the rANS encoder codes blocks of 2^kWideBlockLog2
// symbols with kWideLanes lanes: two states per GPU lane at the chain length
// (and, measured, the ratio) of 2^14-symbol blocks with 32. Below it, twice
// the work per block costs more latency than the second chain saves (bf16 at
// 16 and 64 MiB measured slower; bench/NOTES.md, format v4).
constexpr int kWideBlockLog2 = 15;
constexpr uint64_t kWideMinSymbols = 1ull << 27;

constexpr int kFixedHeaderBytes = 32;
constexpr int kMaxDims = 16;
constexpr int kMaxHeaderBytes = kFixedHeaderBytes + 8 * kMaxDims;
constexpr int kAlign = 16;
// Largest element count (and largest single dimension) a header may name:
// 2^48 elements keep every byte count below 2^53, far from wrapping.
constexpr uint64_t kMaxNumel = 1ull << 48;
// Raw (codec 0) payloads carry one checksum per chunk of 2^16 bytes.
constexpr int kRawChunkLog2 = 16;
// Byte offset of the header checksum (version 2).
constexpr int kHeaderSumOffset = 28;

// Rans: interleaved rANS over the symbols. Fixed: a ZipCCL-style fixed-length
// code (the block's 7 most frequent symbols get 3-bit codes, code 7 escapes to
// the symbol byte): a worse ratio, no sequential dependency at all.
enum class Codec : uint8_t { Raw = 0, Rans = 1, Fixed = 2 };
constexpr uint8_t kNumCodecs = 3;

// Block segment modes. A segment is stored or in its stream's codec.
constexpr uint8_t kModeStored = 0;
constexpr uint8_t kModeRans = 1;
constexpr uint8_t kModeFixed = 2;
// Fixed segment: mode, 7 table symbols, u32 escape count, then per 32-symbol
// step three u32 bit planes (bit L of plane j = bit j of the code of the
// step's symbol L), then the escaped symbols in order.
constexpr int kFixedCodes = 7;
constexpr uint32_t kFixedEscape = 7;
constexpr uint32_t kFixedPrefixBytes = 12;
PZ_HOST_DEVICE constexpr uint64_t fixed_planes_bytes(uint64_t nsym_in_block) {
  return 12 * ((nsym_in_block + kLanes - 1) / kLanes);
}
// Frequency table forms.
constexpr uint8_t kTableRange = 0;
constexpr uint8_t kTableBitmap = 1;

// Dtype codes are part of the format: never renumber.
enum class DType : uint8_t {
  Invalid = 0,
  BFloat16 = 1,
  Float16 = 2,
  Float32 = 3,
  Float8E4M3FN = 4,
  Float8E5M2 = 5,
  Float64 = 6,
  UInt8 = 7,
  Int8 = 8,
  Int16 = 9,
  Int32 = 10,
  Int64 = 11,
  Bool = 12,
  Complex64 = 13,
  Complex128 = 14,
  Float8E4M3FNUZ = 15,
  Float8E5M2FNUZ = 16,
  UInt16 = 17,
  UInt32 = 18,
  UInt64 = 19,
  Complex32 = 20,
  Float8E8M0FNU = 21,
  Count = 22,
};

PZ_HOST_DEVICE constexpr int elem_size(DType d) {
  switch (d) {
    case DType::BFloat16: case DType::Float16: case DType::Int16: case DType::UInt16: return 2;
    case DType::Float32: case DType::Int32: case DType::UInt32: case DType::Complex32: return 4;
    case DType::Float64: case DType::Int64: case DType::UInt64: case DType::Complex64: return 8;
    case DType::Complex128: return 16;
    case DType::Float8E4M3FN: case DType::Float8E5M2: case DType::UInt8: case DType::Int8:
    case DType::Bool: case DType::Float8E4M3FNUZ: case DType::Float8E5M2FNUZ:
    case DType::Float8E8M0FNU: return 1;
    default: return 0;
  }
}

// Dtypes with an exponent split; all others are stored raw.
PZ_HOST_DEVICE constexpr bool is_coded(DType d) {
  return d == DType::BFloat16 || d == DType::Float16 || d == DType::Float32 ||
         d == DType::Float8E4M3FN || d == DType::Float8E5M2;
}

PZ_HOST_DEVICE constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Symbols per element stream: fp8 packs two elements into one symbol.
PZ_HOST_DEVICE constexpr uint64_t num_symbols(DType d, uint64_t numel) {
  return (d == DType::Float8E4M3FN || d == DType::Float8E5M2) ? (numel + 1) / 2 : numel;
}

// Raw planes: an 8-bit plane (one byte per symbol) always; fp32 adds a 16-bit
// plane holding the low mantissa bits.
PZ_HOST_DEVICE constexpr bool has_plane16(DType d) { return d == DType::Float32; }

// Tensor bytes per symbol (an fp8 symbol is a pair of elements).
PZ_HOST_DEVICE constexpr uint32_t symbol_bytes(DType d) { return d == DType::Float32 ? 4 : 2; }

PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t get_u32(const uint8_t* p) {
  return p[0] | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
PZ_HOST_DEVICE PZ_FORCE_INLINE void put_u32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
  p[2] = uint8_t(v >> 16);
  p[3] = uint8_t(v >> 24);
}

// The checksum of format version 2: a sum, mod 2^32, of one term per 32-bit
// unit, term = fmix32(unit ^ index * 0x9E3779B9) (MurmurHash3's finalizer).
// A sum of independent terms has no order, so 32 lanes (or threads, or SIMD
// registers) each add their share and one reduction finishes it: no extra
// pass over the data and no sequential dependency. fmix32 and the XOR are
// bijections, so any change to a single unit always changes the sum; other
// changes escape with probability about 2^-32. The index makes the sum
// position-dependent (swapped units are caught).
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t hash_term(uint32_t unit, uint32_t index) {
  uint32_t t = unit ^ (index * 0x9E3779B9u);
  t ^= t >> 16;
  t *= 0x85EBCA6Bu;
  t ^= t >> 13;
  t *= 0xC2B2AE35u;
  t ^= t >> 16;
  return t;
}

// Every v2 checksum is this seed plus its sum of terms. term(0, 0) is 0, so
// without a seed a zeroed region (data and checksum alike: a classic
// corruption) would check out whenever its terms sum to zero.
constexpr uint32_t kChecksumSeed = 0x505A4932u;  // "2IZP"
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t finish_checksum(uint32_t sum) { return sum + kChecksumSeed; }

struct Header {
  uint8_t version = kVersion;
  DType dtype = DType::Invalid;
  Codec codec = Codec::Raw;
  uint8_t ndim = 0;
  uint64_t total_bytes = 0;  // the whole stream, header included
  uint64_t numel = 0;
  uint8_t block_log2 = 0;    // 0 for Codec::Raw
  uint8_t lanes = kLanes;    // rANS interleave width: kLanes, or kWideLanes (v4)
  int64_t shape[kMaxDims] = {};
};

// Where each region starts; derived from the header alone.
struct Layout {
  uint64_t header_bytes;   // fixed part + shape
  uint64_t nsym;           // symbols (0 for Codec::Raw)
  uint64_t nblocks;
  uint64_t raw_begin;      // Raw codec: payload; Rans: plane8
  uint64_t plane16_begin;  // fp32 only
  uint64_t raw_end;
  uint64_t offsets_begin;  // u64 end offset of each block, relative to coded_begin
  uint64_t sums_begin;     // v2: u32 checksum of each block (coded) or payload chunk (raw)
  uint64_t nsums;          // v2: how many; 0 in v1
  uint64_t coded_begin;    // Raw codec: the end of the stream
  uint64_t total;          // h.total_bytes: where the last block segment ends
};

PZ_HOST_DEVICE inline Layout layout_of(const Header& h) {
  Layout l{};
  l.total = h.total_bytes;
  l.header_bytes = kFixedHeaderBytes + 8ull * h.ndim;
  l.raw_begin = align_up(l.header_bytes, kAlign);
  const bool sums = h.version >= 2;
  if (h.codec == Codec::Raw) {
    l.raw_end = l.raw_begin + h.numel * static_cast<uint64_t>(elem_size(h.dtype));
    l.plane16_begin = l.offsets_begin = l.raw_end;
    if (!sums) {
      l.sums_begin = l.coded_begin = l.raw_end;
      return l;
    }
    l.sums_begin = align_up(l.raw_end, kAlign);
    l.nsums = (l.raw_end - l.raw_begin + (1ull << kRawChunkLog2) - 1) >> kRawChunkLog2;
    l.coded_begin = l.sums_begin + 4 * l.nsums;
    return l;
  }
  l.nsym = num_symbols(h.dtype, h.numel);
  l.nblocks = (l.nsym + (1ull << h.block_log2) - 1) >> h.block_log2;
  l.plane16_begin = align_up(l.raw_begin + l.nsym, kAlign);
  l.raw_end = has_plane16(h.dtype) ? l.plane16_begin + 2 * l.nsym : l.raw_begin + l.nsym;
  l.offsets_begin = align_up(l.raw_end, kAlign);
  l.sums_begin = l.offsets_begin + 8 * l.nblocks;
  l.nsums = sums ? l.nblocks : 0;
  l.coded_begin = align_up(l.sums_begin + 4 * l.nsums, kAlign);
  return l;
}

// Symbols in block b.
PZ_HOST_DEVICE inline uint32_t block_symbols(const Header& h, const Layout& l, uint64_t b) {
  const uint64_t begin = b << h.block_log2;
  const uint64_t end = begin + (1ull << h.block_log2);
  return static_cast<uint32_t>((end < l.nsym ? end : l.nsym) - begin);
}

// Largest a block segment can be: mode byte + stored symbols, padded.
PZ_HOST_DEVICE constexpr uint64_t max_segment_bytes(uint64_t nsym_in_block) {
  return align_up(1 + nsym_in_block, kAlign);
}

// Deterministic block size from the symbol count alone: 2^12 symbols (never
// less: table/state overhead); 2^13 once 512 such blocks fit (2^22 symbols);
// 2^14 once 2048 do (2^25). A block is one GPU group's serial chain, and with
// few groups most of the GPU's schedulers idle: at 4 MiB of bf16, 2^12 took
// 26% / 34% less time to compress / decompress than 2^13 (H200), and at
// 32 MiB 2^13 took 11% / 30% less than 2^14 (H100), each for 0.004-0.009 of
// ratio (bench/NOTES.md, plan sweeps).
// Where 64 lanes are allowed (`wide`: plan_header says which codec and
// dtypes), kWideBlockLog2 from kWideMinSymbols on.
constexpr uint64_t kBlocks13 = 512, kBlocks14 = 2048;
inline int choose_block_log2(uint64_t nsym, bool wide) {
  if (wide && nsym >= kWideMinSymbols) return kWideBlockLog2;
  return (nsym >> 14) >= kBlocks14 ? 14 : (nsym >> 13) >= kBlocks13 ? 13 : 12;
}

// Symbols per rANS row: kLaneRun per lane.
PZ_HOST_DEVICE constexpr uint32_t row_symbols(int lanes) { return static_cast<uint32_t>(lanes) * kLaneRun; }

// The header the encoder writes for a tensor (total_bytes filled in later).
inline Header plan_header(DType d, uint64_t numel, const int64_t* shape, int ndim, Codec codec = Codec::Rans) {
  Header h;
  h.dtype = d;
  h.numel = numel;
  h.ndim = static_cast<uint8_t>(ndim);
  for (int i = 0; i < ndim; ++i) h.shape[i] = shape[i];
  if (is_coded(d) && numel > 0 && codec != Codec::Raw) {
    h.codec = codec;
    // fp32 stays at 32 lanes: its 64-lane decoder measured slower (bench/NOTES.md, format v4).
    const bool wide = codec == Codec::Rans && d != DType::Float32;
    h.block_log2 = static_cast<uint8_t>(choose_block_log2(num_symbols(d, numel), wide));
    h.lanes = wide && h.block_log2 == kWideBlockLog2 ? kWideLanes : kLanes;
  }
  return h;
}

PZ_HOST_DEVICE inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
PZ_HOST_DEVICE inline uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The stream's total size (header included) is the u64 at kTotalBytesOffset,
// within the fixed header, so its first kTotalBytesEnd bytes say how long a
// stream is before the rest arrives: what a transport sizing a message, or
// Python reading a GPU stream's size, asks of the format. A whole stream is
// never shorter than kFixedHeaderBytes (parse_header's TooShort).
constexpr int kTotalBytesOffset = 8;
constexpr int kTotalBytesEnd = kTotalBytesOffset + 8;
static_assert(kTotalBytesEnd <= kFixedHeaderBytes, "the size field lies inside the fixed header");

// *total = the stream's size field, read from the first `avail` bytes of a
// stream at p; false (and *total untouched) when they end before the field
// does. The value is unchecked: parse_header validates it.
PZ_HOST_DEVICE inline bool stream_total_bytes(const uint8_t* p, uint64_t avail, uint64_t* total) {
  if (avail < kTotalBytesEnd) return false;
  *total = get_u64(p + kTotalBytesOffset);
  return true;
}

// The header's 32-bit word k as the checksum sees it: the total (its size
// field) is taken from `total` (the GPU encoder learns it last), the checksum
// field itself is zero.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t header_word(const uint8_t* p, uint32_t k, uint64_t total) {
  return k == kTotalBytesOffset / 4 ? static_cast<uint32_t>(total)
         : k == kTotalBytesOffset / 4 + 1 ? static_cast<uint32_t>(total >> 32)
         : k == kHeaderSumOffset / 4 ? 0u : get_u32(p + 4 * k);
}

// Version 2 header checksum: hash_term over the header's words (fixed part
// and shape), word index as the index.
PZ_HOST_DEVICE inline uint32_t header_checksum(const uint8_t* p, uint64_t header_bytes, uint64_t total) {
  uint32_t s = 0;
  for (uint32_t k = 0; k < header_bytes / 4; ++k) s += hash_term(header_word(p, k, total), k);
  return finish_checksum(s);
}

// Writes header_bytes bytes, then zero padding up to raw_begin.
inline void write_header(const Header& h, uint8_t* out) {
  const Layout l = layout_of(h);
  for (uint64_t i = 0; i < l.raw_begin; ++i) out[i] = 0;
  for (int i = 0; i < 4; ++i) out[i] = kMagic[i];
  out[4] = h.version;
  out[5] = static_cast<uint8_t>(h.dtype);
  out[6] = static_cast<uint8_t>(h.codec);
  out[7] = h.ndim;
  put_u64(out + kTotalBytesOffset, h.total_bytes);
  put_u64(out + 16, h.numel);
  out[24] = h.block_log2;
  out[25] = kProbBits;
  out[26] = h.lanes;
  for (int d = 0; d < h.ndim; ++d) put_u64(out + kFixedHeaderBytes + 8 * d, static_cast<uint64_t>(h.shape[d]));
  if (h.version >= 2) put_u32(out + kHeaderSumOffset, header_checksum(out, l.header_bytes, h.total_bytes));
}

// Worst-case stream size: every block stored.
PZ_HOST_DEVICE inline uint64_t max_stream_bytes(const Header& h) {
  const Layout l = layout_of(h);
  if (h.codec == Codec::Raw) return l.coded_begin;
  uint64_t total = l.coded_begin;
  const uint64_t full = l.nblocks ? l.nblocks - 1 : 0;
  total += full * max_segment_bytes(1ull << h.block_log2);
  if (l.nblocks) total += max_segment_bytes(block_symbols(h, l, l.nblocks - 1));
  return total;
}

enum class ParseError {
  Ok = 0,
  TooShort,
  BadMagic,
  BadVersion,
  BadDType,
  BadCodec,
  BadNdim,
  BadParams,
  BadShape,
  BadTotal,
  BadChecksum,
  Truncated,
};

inline const char* parse_error_text(ParseError e) {
  switch (e) {
    case ParseError::Ok: return "ok";
    case ParseError::TooShort: return "stream is shorter than the fixed 32-byte header";
    case ParseError::BadMagic: return "bad magic: not a portable_zip stream";
    case ParseError::BadVersion: return "unsupported format version";
    case ParseError::BadDType: return "unknown dtype code in header";
    case ParseError::BadCodec: return "unknown codec code in header";
    case ParseError::BadNdim: return "ndim in header exceeds 16 or the stream ends inside the shape";
    case ParseError::BadParams: return "header codec parameters (block size, probability bits, lane count, reserved bytes) are invalid";
    case ParseError::BadShape: return "header shape is negative, too large (a dimension or the element count over 2^48) or does not multiply to numel";
    case ParseError::BadTotal: return "header total size is inconsistent with its layout";
    case ParseError::BadChecksum: return "header checksum mismatch: the header is corrupted (or was edited)";
    case ParseError::Truncated: return "stream is truncated: shorter than the total size in its header";
  }
  return "unknown error";
}

// Validates every header field. p holds the first head_len bytes of a stream
// of stream_len bytes. After Ok, the layout's regions all lie inside
// [0, total_bytes) and total_bytes <= stream_len.
// Host and device: a GPU decode with no host sync parses on the device.
PZ_HOST_DEVICE inline ParseError parse_header(const uint8_t* p, uint64_t head_len, uint64_t stream_len, Header* h) {
  const uint64_t len = head_len < stream_len ? head_len : stream_len;
  if (len < kFixedHeaderBytes) return ParseError::TooShort;
  if (get_u32(p) != kMagicWord) return ParseError::BadMagic;
  h->version = p[4];
  if (h->version < kMinVersion || h->version > kVersion) return ParseError::BadVersion;
  if (p[5] == 0 || p[5] >= static_cast<uint8_t>(DType::Count)) return ParseError::BadDType;
  h->dtype = static_cast<DType>(p[5]);
  if (p[6] >= kNumCodecs) return ParseError::BadCodec;
  h->codec = static_cast<Codec>(p[6]);
  h->ndim = p[7];
  if (h->ndim > kMaxDims || len < kFixedHeaderBytes + 8ull * h->ndim) return ParseError::BadNdim;
  h->total_bytes = get_u64(p + kTotalBytesOffset);
  h->numel = get_u64(p + 16);
  h->block_log2 = p[24];
  h->lanes = p[26];
  // Byte 27 is zero; bytes 28..31 are zero in v1 and the header checksum in v2.
  // Lanes: 32, or 64 for a v4 rANS stream.
  const bool wide = h->lanes == kWideLanes && h->version >= kWideVersion && h->codec == Codec::Rans;
  if (p[25] != kProbBits || (h->lanes != kLanes && !wide) || p[27] != 0 ||
      (h->version < 2 && get_u64(p + 24) >> 32 != 0))
    return ParseError::BadParams;
  if (h->codec != Codec::Raw) {
    if (!is_coded(h->dtype) || h->block_log2 < kMinBlockLog2 || h->block_log2 > kMaxBlockLog2)
      return ParseError::BadParams;
  } else if (h->block_log2 != 0) {
    return ParseError::BadParams;
  }
  // Shape must multiply to numel. The product of the nonzero dimensions is
  // bounded too, so a zero dimension cannot hide a huge one (a shape no
  // tensor library can allocate, even empty).
  uint64_t prod = 1;
  bool zero = false;
  for (int d = 0; d < h->ndim; ++d) {
    const int64_t s = static_cast<int64_t>(get_u64(p + kFixedHeaderBytes + 8 * d));
    if (s < 0) return ParseError::BadShape;
    h->shape[d] = s;
    if (s == 0) zero = true;
    else if (prod > kMaxNumel / static_cast<uint64_t>(s)) return ParseError::BadShape;
    else prod *= static_cast<uint64_t>(s);
  }
  if (zero) prod = 0;
  if (prod != h->numel) return ParseError::BadShape;
  const Layout l = layout_of(*h);
  if (h->codec == Codec::Raw) {
    if (h->total_bytes != l.coded_begin) return ParseError::BadTotal;
  } else {
    // Every block holds at least its mode byte, padded to 16.
    if (h->total_bytes < l.coded_begin + kAlign * l.nblocks) return ParseError::BadTotal;
    if (h->total_bytes > max_stream_bytes(*h)) return ParseError::BadTotal;
  }
  // Last: every field is in range, so a mismatch means a relabelled or
  // corrupted header whose fields merely look plausible.
  if (h->version >= 2 && get_u32(p + kHeaderSumOffset) != header_checksum(p, l.header_bytes, h->total_bytes))
    return ParseError::BadChecksum;
  if (h->total_bytes > stream_len) return ParseError::Truncated;
  return ParseError::Ok;
}

}  // namespace pz::fmt
