// Host check of swar.h's word split and join (the GPU kernels' split_chunk
// and join_row) against FloatTraits, built and run by tests/test_swar.py.
// For every 8-symbol chunk tried: split_words gives exactly the symbols, raw
// bytes and raw16 halves that FloatTraits::split gives element by element,
// and join_words gives the chunk's words back bit for bit. 16-bit symbols
// (bf16, fp16, fp8 pairs): every 16-bit value in every position; fp32: every
// value of each 16-bit half in every position, edge values, and random
// chunks. Usage: check_swar SEED RANDOM_CHUNKS
#include <stdio.h>
#include <stdlib.h>

#include <random>

#include "portable_zip/dtype_traits.h"
#include "portable_zip/swar.h"

using namespace pz;

static long g_failures = 0;

template <fmt::DType D>
constexpr int kWords = D == fmt::DType::Float32 ? 8 : 4;

template <fmt::DType D>
constexpr bool kIsFp8 = D == fmt::DType::Float8E4M3FN || D == fmt::DType::Float8E5M2;

template <fmt::DType D>
const char* name() {
  switch (D) {
    case fmt::DType::BFloat16: return "bf16";
    case fmt::DType::Float16: return "fp16";
    case fmt::DType::Float32: return "fp32";
    case fmt::DType::Float8E4M3FN: return "e4m3fn";
    default: return "e5m2";
  }
}

template <fmt::DType D>
void fail(const uint32_t* in, const char* what, int k) {
  if (g_failures++ < 10) {
    fprintf(stderr, "%s: %s %d differs for chunk", name<D>(), what, k);
    for (int i = 0; i < kWords<D>; ++i) fprintf(stderr, " %08x", in[i]);
    fprintf(stderr, "\n");
  }
}

// One chunk: split_words against FloatTraits::split, then join_words back.
template <fmt::DType D>
void check(const uint32_t* in) {
  using T = FloatTraits<D>;
  uint8_t bytes[4 * kWords<D>];
  for (int i = 0; i < 4 * kWords<D>; ++i) bytes[i] = static_cast<uint8_t>(in[i / 4] >> (8 * (i % 4)));
  uint32_t sym[2], raw8[2], raw16[4] = {0xdeadbeef, 0xdeadbeef, 0xdeadbeef, 0xdeadbeef};
  split_words<D>(in, sym, raw8, raw16);
  uint32_t syms[8];
  for (int k = 0; k < 8; ++k) {
    const Split s = T::split(bytes, k, 16);  // numel 16: fp8's pairs are all whole
    syms[k] = (sym[k >> 2] >> (8 * (k & 3))) & 0xff;
    if (syms[k] != s.sym) fail<D>(in, "symbol", k);
    if (((raw8[k >> 2] >> (8 * (k & 3))) & 0xff) != s.raw8) fail<D>(in, "raw byte", k);
    const uint32_t r16 = D == fmt::DType::Float32 ? (raw16[k >> 1] >> (16 * (k & 1))) & 0xffff : raw16[k >> 1];
    if (r16 != (D == fmt::DType::Float32 ? s.raw16 : 0xdeadbeefu)) fail<D>(in, "raw16 of symbol", k);
  }
  uint32_t w[kWords<D>];
  join_words<D>(syms, raw8[0], raw8[1], raw16, w);
  for (int i = 0; i < kWords<D>; ++i)
    if (w[i] != in[i]) fail<D>(in, "joined word", i);
}

// Every 16-bit value v in every position p of a chunk; the other positions
// hold random values (fp32: v is the high half, then the low half, of
// element p, the other half random).
template <fmt::DType D>
void every_half(std::mt19937_64& rng) {
  uint32_t in[kWords<D>];
  for (int p = 0; p < 2 * kWords<D>; ++p)
    for (uint32_t v = 0; v < 0x10000; ++v) {
      for (int i = 0; i < kWords<D>; ++i) in[i] = static_cast<uint32_t>(rng());
      const int sh = 16 * (p & 1);
      in[p >> 1] = (in[p >> 1] & ~(0xffffu << sh)) | v << sh;
      check<D>(in);
    }
}

// Zeros, signed zeros, infinities, NaNs, denormals, extremes, all-ones and
// alternating bits, per element width.
static const uint32_t kEdge32[] = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001,
                                   0x7fffffff, 0xffffffff, 0x00000001, 0x007fffff, 0x80000001, 0x807fffff, 0x00800000,
                                   0x3f800000, 0xbf800000, 0x7f7fffff, 0xff7fffff, 0x55555555, 0xaaaaaaaa};
static const uint32_t kEdge16[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7c00, 0xfc00, 0x7e00, 0x7fff,
                                   0xffff, 0x0001, 0x8001, 0x03ff, 0x007f, 0x3c00, 0x3f80, 0x5555, 0xaaaa};
static const uint32_t kEdge8[] = {0x00, 0x80, 0x7f, 0xff, 0x7e, 0xfe, 0x7d, 0x7c, 0xfc, 0x01, 0x81,
                                  0x03, 0x07, 0x08, 0x78, 0x38, 0x55, 0xaa};

// Random chunks, each element an edge value 1 time in 4; chunks of edge
// values only; then whole chunks of one edge value.
template <fmt::DType D>
void random_chunks(std::mt19937_64& rng, long count) {
  constexpr int kElems = kIsFp8<D> ? 16 : 8, kBits = 32 * kWords<D> / kElems;
  const uint32_t* edges = kBits == 32 ? kEdge32 : kBits == 16 ? kEdge16 : kEdge8;
  const size_t nedges = kBits == 32 ? sizeof kEdge32 / 4 : kBits == 16 ? sizeof kEdge16 / 4 : sizeof kEdge8 / 4;
  auto put = [](uint32_t* in, int e, uint32_t v) {
    const int sh = (e * kBits) % 32;
    const uint32_t mask = kBits == 32 ? ~0u : ((1u << kBits) - 1) << sh;
    in[e * kBits / 32] = (in[e * kBits / 32] & ~mask) | v << sh;
  };
  uint32_t in[kWords<D>] = {};
  for (long it = 0; it < count; ++it) {
    for (int i = 0; i < kWords<D>; ++i) in[i] = static_cast<uint32_t>(rng());
    const uint64_t r = rng();
    for (int e = 0; e < kElems; ++e)
      if (((r >> (2 * e)) & 3) == 0) put(in, e, edges[rng() % nedges]);
    check<D>(in);
  }
  for (long it = 0; it < count / 8; ++it) {
    for (int e = 0; e < kElems; ++e) put(in, e, edges[rng() % nedges]);
    check<D>(in);
  }
  for (size_t k = 0; k < nedges; ++k) {
    for (int e = 0; e < kElems; ++e) put(in, e, edges[k]);
    check<D>(in);
  }
}

template <fmt::DType D>
void run(std::mt19937_64& rng, long count) {
  const long before = g_failures;
  every_half<D>(rng);
  random_chunks<D>(rng, count);
  printf("%s: %s\n", name<D>(), g_failures == before ? "ok" : "FAILED");
}

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1;
  const long count = argc > 2 ? atol(argv[2]) : 1000000;
  std::mt19937_64 rng(seed);
  run<fmt::DType::BFloat16>(rng, count);
  run<fmt::DType::Float16>(rng, count);
  run<fmt::DType::Float32>(rng, count);
  run<fmt::DType::Float8E4M3FN>(rng, count);
  run<fmt::DType::Float8E5M2>(rng, count);
  printf("%ld failures\n", g_failures);
  return g_failures != 0;
}
