// rANS math shared by every backend: frequency quantization, the compact
// table encoding, and the per-symbol encode/decode steps. All integer and
// deterministic, so CPU and GPU produce identical bytes.
#pragma once
#include <stdint.h>

#include "format.h"

namespace pz::rans {

using fmt::kProbBits;
using fmt::kProbScale;
using fmt::kStateLow;

// Counts -> frequencies summing to exactly kProbScale, every seen symbol >= 1.
// Rounded proportional shares; the residue goes to (or comes from) the most
// frequent symbols, where it costs the fewest bits.
PZ_HOST_DEVICE inline void quantize(const uint32_t* hist, uint32_t n, uint16_t* freq) {
  int32_t sum = 0;
  int best = 0;
  uint32_t best_count = 0;
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    const uint32_t c = hist[s];
    uint32_t f = 0;
    if (c) {
      f = static_cast<uint32_t>((static_cast<uint64_t>(c) * kProbScale + n / 2) / n);
      if (f == 0) f = 1;
      if (c > best_count) best_count = c, best = s;
    }
    freq[s] = static_cast<uint16_t>(f);
    sum += static_cast<int32_t>(f);
  }
  int32_t d = static_cast<int32_t>(kProbScale) - sum;
  if (d > 0) freq[best] = static_cast<uint16_t>(freq[best] + d);
  while (d < 0) {
    int top = 0;
    for (int s = 1; s < fmt::kNumSymbols; ++s)
      if (freq[s] > freq[top]) top = s;
    const int32_t take = -d < freq[top] - 1 ? -d : freq[top] - 1;
    freq[top] = static_cast<uint16_t>(freq[top] - take);
    d += take;
  }
}

// Frequencies are written as 1 byte (< 128) or 2 bytes (0x80 | hi, lo).
PZ_HOST_DEVICE PZ_FORCE_INLINE int varint_bytes(uint32_t f) { return f < 128 ? 1 : 2; }

PZ_HOST_DEVICE PZ_FORCE_INLINE uint8_t* put_varint(uint8_t* p, uint32_t f) {
  if (f < 128) {
    *p++ = static_cast<uint8_t>(f);
  } else {
    *p++ = static_cast<uint8_t>(0x80 | (f >> 8));
    *p++ = static_cast<uint8_t>(f);
  }
  return p;
}

// Table = form byte + body. Range form: lo, hi, varint per symbol in [lo, hi].
// Bitmap form: 32-byte presence bitmap, varint per present symbol. The smaller
// wins (range on ties). Returns bytes written.
PZ_HOST_DEVICE inline int write_table(const uint16_t* freq, uint8_t* out) {
  int lo = -1, hi = -1, present = 0, range_bytes = 0, bitmap_bytes = 0;
  for (int s = 0; s < fmt::kNumSymbols; ++s) {
    if (!freq[s]) continue;
    if (lo < 0) lo = s;
    hi = s;
    ++present;
    bitmap_bytes += varint_bytes(freq[s]);
  }
  (void)present;
  for (int s = lo; s <= hi; ++s) range_bytes += varint_bytes(freq[s]);
  range_bytes += 2;
  bitmap_bytes += 32;
  uint8_t* p = out;
  if (range_bytes <= bitmap_bytes) {
    *p++ = fmt::kTableRange;
    *p++ = static_cast<uint8_t>(lo);
    *p++ = static_cast<uint8_t>(hi);
    for (int s = lo; s <= hi; ++s) p = put_varint(p, freq[s]);
  } else {
    *p++ = fmt::kTableBitmap;
    for (int i = 0; i < 32; ++i) p[i] = 0;
    for (int s = 0; s < fmt::kNumSymbols; ++s)
      if (freq[s]) p[s >> 3] = static_cast<uint8_t>(p[s >> 3] | (1u << (s & 7)));
    p += 32;
    for (int s = 0; s < fmt::kNumSymbols; ++s)
      if (freq[s]) p = put_varint(p, freq[s]);
  }
  return static_cast<int>(p - out);
}

// Parses a table from [p, end). Returns bytes consumed, or -1 if the table is
// malformed: overruns end, bad form, zero frequency for a present symbol, or
// frequencies that do not sum to kProbScale.
PZ_HOST_DEVICE inline int parse_table(const uint8_t* p, const uint8_t* end, uint16_t* freq) {
  const uint8_t* q = p;
  for (int s = 0; s < fmt::kNumSymbols; ++s) freq[s] = 0;
  if (q >= end) return -1;
  const uint8_t form = *q++;
  auto get = [&](uint32_t* f) -> bool {
    if (q >= end) return false;
    uint32_t v = *q++;
    if (v & 0x80) {
      if (q >= end) return false;
      v = ((v & 0x7f) << 8) | *q++;
    }
    *f = v;
    return v <= kProbScale;
  };
  uint32_t sum = 0;
  if (form == fmt::kTableRange) {
    if (end - q < 2) return -1;
    const int lo = q[0], hi = q[1];
    q += 2;
    if (hi < lo) return -1;
    for (int s = lo; s <= hi; ++s) {
      uint32_t f;
      if (!get(&f)) return -1;
      freq[s] = static_cast<uint16_t>(f);
      sum += f;
    }
  } else if (form == fmt::kTableBitmap) {
    if (end - q < 32) return -1;
    const uint8_t* bm = q;
    q += 32;
    for (int s = 0; s < fmt::kNumSymbols; ++s) {
      if (!(bm[s >> 3] >> (s & 7) & 1)) continue;
      uint32_t f;
      if (!get(&f) || f == 0) return -1;
      freq[s] = static_cast<uint16_t>(f);
      sum += f;
    }
  } else {
    return -1;
  }
  if (sum != kProbScale) return -1;
  return static_cast<int>(q - p);
}

// Bytes before the words in a rANS segment: mode, table, pad to 4, word
// count, one state per lane (the header's lane count).
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t rans_prefix_bytes(int table_bytes, int lanes) {
  return static_cast<uint32_t>(fmt::align_up(1 + table_bytes, 4) + 4 + 4 * lanes);
}

// Encoder renormalization: emit the low 16 bits while x would overflow.
// With 32-bit states, 16-bit words and 12-bit probabilities one word suffices.
PZ_HOST_DEVICE PZ_FORCE_INLINE bool enc_renorm_needed(uint32_t x, uint32_t freq) {
  return static_cast<uint64_t>(x) >= (static_cast<uint64_t>(freq) << (32 - kProbBits));
}

PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t enc_put(uint32_t x, uint32_t freq, uint32_t cum) {
  return ((x / freq) << kProbBits) + (x % freq) + cum;
}

// Exact x / f for every 32-bit x without a divide (Granlund-Montgomery,
// round-up variant): q = (t + ((x - t) >> 1)) >> shift, t = mulhi(x, magic).
// f == 1 is special-cased by the caller-visible encoding shift = 31, magic = 0.
struct DivMagic {
  uint32_t magic;
  uint32_t shift;
};

PZ_HOST_DEVICE inline DivMagic div_magic(uint32_t f) {
  if (f <= 1) return {0u, 31u};
  uint32_t l = 0;
  while ((1u << l) < f) ++l;  // ceil(log2 f), f <= 4096
  const uint64_t m = ((static_cast<uint64_t>(1) << 32) * ((static_cast<uint64_t>(1) << l) - f)) / f + 1;
  return {static_cast<uint32_t>(m), l - 1};
}

PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t div_by_magic(uint32_t x, DivMagic d) {
  if (d.shift == 31) return x;  // f == 1
  const uint32_t t = mulhi32(x, d.magic);
  return (t + ((x - t) >> 1)) >> d.shift;
}

// enc_put with the division replaced by the magic multiply; identical results.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t enc_put_magic(uint32_t x, uint32_t freq, uint32_t cum, DivMagic d) {
  const uint32_t q = div_by_magic(x, d);
  return (q << kProbBits) + (x - q * freq) + cum;
}

// The encoder's table entry for a symbol of frequency f and cumulative
// frequency cum, two words: g | cum' << 12 | shift << 28, and a magic, where
// g = 4096 - f, so that
//   renormalize:  x >= f << 20  <=>  (x >> 20) + g > 4095
//   put:          (q << 12) + (x - q * f) + cum = x + q * g + cum
// with q = x / f by the magic multiply (div_by_magic without its f == 1
// test). f == 1 (div_magic's shift 31: q = x) takes magic 2^32 - 1 and shift 0
// instead, for which the same multiply gives q = x - 1 (t = x - 1 for
// 1 <= x < 2^32), made good by cum' = cum + 4095:
// x + (x - 1) * 4095 + cum + 4095 = 4096 x + cum. cum' < 2^13, shift <= 11.
// Same results as enc_renorm_needed and enc_put, in fewer steps: the CPU's
// AVX2 encoder and the GPU encoder use it.
struct EncEntry {
  uint32_t w;
  uint32_t magic;
};

PZ_HOST_DEVICE PZ_FORCE_INLINE EncEntry enc_entry(uint32_t f, uint32_t cum, DivMagic d) {  // d = div_magic(f)
  const bool one = d.shift == 31;
  return {(kProbScale - f) | (cum + (one ? kProbScale - 1 : 0)) << 12 | (one ? 0u : d.shift) << 28,
          one ? 0xffffffffu : d.magic};
}

PZ_HOST_DEVICE PZ_FORCE_INLINE bool enc_entry_renorm(uint32_t x, uint32_t w) {
  return (x >> (32 - kProbBits)) + (w & (kProbScale - 1)) > kProbScale - 1;
}

PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t enc_entry_put(uint32_t x, uint32_t w, uint32_t magic) {
  const uint32_t t = mulhi32(x, magic);
  const uint32_t q = (t + ((x - t) >> 1)) >> (w >> 28);
  return x + q * (w & (kProbScale - 1)) + ((w >> 12) & 0x1fff);
}

// Decoder step; the caller refills with a word when the result is < kStateLow.
// Cannot overflow for any 32-bit x when the table is valid.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t dec_step(uint32_t x, uint32_t freq, uint32_t cum) {
  return freq * (x >> kProbBits) + (x & (kProbScale - 1)) - cum;
}

}  // namespace pz::rans
