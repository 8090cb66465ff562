// Mutation fuzzer for the CPU decoder, built with AddressSanitizer and UBSan
// by tests/test_fuzz.py. Every mutated stream must either fail header
// validation, report a DecodeError, or decode; ASan aborts on any
// out-of-bounds access. Usage: fuzz_decode SEED ITERATIONS
#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#include "launch.h"
#include "portable_zip/block.h"

using namespace pz;

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1;
  const int iters = argc > 2 ? atoi(argv[2]) : 10000;
  std::mt19937_64 rng(seed);
  const fmt::DType dtypes[] = {fmt::DType::BFloat16, fmt::DType::Float16, fmt::DType::Float32,
                               fmt::DType::Float8E4M3FN, fmt::DType::Float8E5M2, fmt::DType::Int32};
  int rejected = 0, decode_errors = 0, decoded = 0;
  for (int it = 0; it < iters; ++it) {
    const fmt::DType d = dtypes[rng() % 6];
    const uint64_t numel = rng() % 3 == 0 ? rng() % 64 : rng() % 40000;
    const int64_t shape[1] = {static_cast<int64_t>(numel)};
    std::vector<uint8_t> in(numel * fmt::elem_size(d));
    // Skewed exponents so most blocks take the rANS or fixed path.
    for (size_t i = 0; i < in.size(); ++i) in[i] = (i % 2 || rng() % 4 == 0) ? 0x3c + rng() % 3 : rng();
    const fmt::Codec codec = rng() % 2 ? fmt::Codec::Rans : fmt::Codec::Fixed;
    fmt::Header h = fmt::plan_header(d, numel, shape, 1, codec);
    // A third of the rANS streams with 64 lanes (format v4; the encoder's
    // plan from 2^27 symbols on) and a random block size.
    if (h.codec == fmt::Codec::Rans && rng() % 3 == 0)
      h.lanes = fmt::kWideLanes, h.block_log2 = static_cast<uint8_t>(fmt::kMinBlockLog2 + rng() % 6);
    std::vector<uint8_t> buf(fmt::max_stream_bytes(h));
    const uint64_t total = cpu_compress(in.data(), h, buf.data(), 1);
    buf.resize(total);
    switch (rng() % 5) {
      case 0: buf.resize(rng() % (total + 1)); break;                        // truncate
      case 1: for (int k = 1 + rng() % 8; k--;) buf[rng() % total] ^= 1u << (rng() % 8); break;
      case 2: buf[rng() % (total < 64 ? total : 64)] = rng(); break;         // header field
      case 3: {                                                               // byte run
        const size_t at = rng() % total, len = 1 + rng() % 64;
        for (size_t i = at; i < at + len && i < total; ++i) buf[i] = rng();
        break;
      }
      default: buf[total - 1 - rng() % (total < 256 ? total : 256)] ^= 0xff;  // tail
    }
    std::vector<uint8_t> stream(buf.begin(), buf.end());  // exact-size heap copy for ASan
    fmt::Header got;
    if (fmt::parse_header(stream.data(), stream.size(), stream.size(), &got) != fmt::ParseError::Ok) {
      ++rejected;
      continue;
    }
    std::vector<uint8_t> out(got.numel * fmt::elem_size(got.dtype));
    if (cpu_decompress(stream.data(), got, out.data(), 1 + rng() % 3)) ++decode_errors;
    else ++decoded;
  }
  printf("fuzz: %d streams: %d rejected by the header, %d decode errors, %d decoded\n", iters, rejected,
         decode_errors, decoded);
  return 0;
}
