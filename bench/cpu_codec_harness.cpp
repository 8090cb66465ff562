// Standalone timing of the CPU codec (include/portable_zip/cpu_codec.h) with
// no Python in the way: cpu::compress / cpu::decompress on synthetic
// N(0, sigma^2) tensors, best of N, GB/s of input bytes, a round-trip check
// and an FNV-1a digest of each stream (equal digests before and after a
// change = the same bytes). PZ_CPU_SIMD=0 selects the scalar paths.
//
//   g++ -O3 -std=c++17 -Iinclude -pthread bench/cpu_codec_harness.cpp -o build/cpu_harness
//   build/cpu_harness [MiB=64] [reps=5] [threads=1,2] [dtypes=bf16,fp16,fp32,e4m3,e5m2]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "portable_zip/cpu_codec.h"

using namespace pz;

static uint16_t to_half(float f) {  // round to nearest even, enough for test data
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t s = (u >> 16) & 0x8000;
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffff;
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(s);
    m |= 0x800000;
    return static_cast<uint16_t>(s | (m >> (14 - e)));
  }
  if (e >= 31) return static_cast<uint16_t>(s | 0x7c00);
  return static_cast<uint16_t>(s | (e << 10) | (m >> 13));
}

static uint8_t to_fp8(float f, bool e5m2) {  // truncating, saturating: plausible fp8 weights
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t s = (u >> 24) & 0x80;
  const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, emax = e5m2 ? 30 : 15;
  int e = static_cast<int>((u >> 23) & 0xff) - 127 + bias;
  const uint32_t m = (u & 0x7fffff) >> (23 - mbits);
  if (e <= 0) return static_cast<uint8_t>(s);
  if (e > emax) e = emax;
  return static_cast<uint8_t>(s | (e << mbits) | m);
}

static std::vector<uint8_t> make(fmt::DType d, uint64_t bytes, float sigma) {
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<uint8_t> v(bytes);
  const int es = fmt::elem_size(d);
  for (uint64_t i = 0; i < bytes / es; ++i) {
    const float f = nd(rng);
    uint32_t u;
    memcpy(&u, &f, 4);
    switch (d) {
      case fmt::DType::BFloat16: { const uint16_t b = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16); memcpy(&v[2 * i], &b, 2); break; }
      case fmt::DType::Float16: { const uint16_t b = to_half(f); memcpy(&v[2 * i], &b, 2); break; }
      case fmt::DType::Float32: memcpy(&v[4 * i], &u, 4); break;
      case fmt::DType::Float8E4M3FN: v[i] = to_fp8(f, false); break;
      case fmt::DType::Float8E5M2: v[i] = to_fp8(f, true); break;
      default: break;
    }
  }
  return v;
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const double mib = argc > 1 ? atof(argv[1]) : 64;
  const int reps = argc > 2 ? atoi(argv[2]) : 5;
  const std::string tlist = argc > 3 ? argv[3] : "1,2";
  const std::string dlist = argc > 4 ? argv[4] : "bf16,fp16,fp32,e4m3,e5m2";
  const char* codec = getenv("PZ_HARNESS_CODEC");
  const fmt::Codec cd = codec && !strcmp(codec, "fixed") ? fmt::Codec::Fixed : fmt::Codec::Rans;
  struct D { const char* name; fmt::DType d; };
  const D all[] = {{"bf16", fmt::DType::BFloat16}, {"fp16", fmt::DType::Float16}, {"fp32", fmt::DType::Float32},
                   {"e4m3", fmt::DType::Float8E4M3FN}, {"e5m2", fmt::DType::Float8E5M2}};
  printf("simd=%s size=%.0f MiB reps=%d\n", cpu::simd::avx2_enabled() ? "avx2" : "scalar", mib, reps);
  for (const D& dd : all) {
    if (dlist.find(dd.name) == std::string::npos) continue;
    const uint64_t bytes = static_cast<uint64_t>(mib * (1 << 20)) / fmt::elem_size(dd.d) * fmt::elem_size(dd.d);
    const float sigma = (dd.d == fmt::DType::Float8E4M3FN || dd.d == fmt::DType::Float8E5M2) ? 1.0f : 0.02f;
    const std::vector<uint8_t> in = make(dd.d, bytes, sigma);
    const int64_t numel = static_cast<int64_t>(bytes / fmt::elem_size(dd.d));
    fmt::Header h = fmt::plan_header(dd.d, numel, &numel, 1, cd);
    std::vector<uint8_t> out(fmt::max_stream_bytes(h)), back(bytes);
    for (size_t p = 0; p < tlist.size(); p += 2) {
      const int threads = tlist[p] - '0';
      double bc = 1e30, bd = 1e30;
      uint64_t total = 0;
      for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        total = cpu::compress(in.data(), h, out.data(), threads);
        bc = std::min(bc, now() - t0);
      }
      fmt::Header hp;
      if (fmt::parse_header(out.data(), total, total, &hp) != fmt::ParseError::Ok) return printf("bad header\n"), 1;
      for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        const uint32_t e = cpu::decompress(out.data(), hp, back.data(), threads);
        bd = std::min(bd, now() - t0);
        if (e) return printf("decode error %u\n", e), 1;
      }
      if (memcmp(in.data(), back.data(), bytes)) return printf("%s: round trip differs\n", dd.name), 1;
      uint64_t fnv = 1469598103934665603ull;
      for (uint64_t i = 0; i < total; ++i) fnv = (fnv ^ out[i]) * 1099511628211ull;
      printf("%-5s t=%d  c %.3f GB/s  d %.3f GB/s  ratio %.4f  digest %016llx\n", dd.name, threads, bytes / bc / 1e9,
             bytes / bd / 1e9, double(total) / bytes, static_cast<unsigned long long>(fnv));
      fflush(stdout);
    }
  }
  return 0;
}
