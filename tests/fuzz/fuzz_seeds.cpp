// Seed corpus and dictionary for tests/fuzz/libfuzz_decode.cpp, made by the
// encoder of the tree it is built from, so a format change regenerates them.
// Usage: fuzz_seeds OUTDIR DICT [STREAM...]
//   OUTDIR gets one seed per stream: a control byte (libfuzz_decode.cpp's
//   thread selector) then the stream. Generated: every coded dtype with both
//   codecs (rANS, fixed), skewed and random data, one block and several
//   (block_log2 10 and the encoder's own choice), rANS with 64 lanes (v4:
//   which the encoder picks only for 2^15-symbol blocks), multi-dimensional and
//   scalar shapes, empty tensors, and raw dtypes. Each STREAM file given (the
//   golden streams) is copied in with a control byte as well.
//   DICT gets a libFuzzer dictionary of the header's constant fields.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <random>
#include <string>
#include <vector>

#include "launch.h"

using namespace pz;

namespace {

std::string g_dir;
int g_count = 0;

void write_seed(const std::string& name, const std::vector<uint8_t>& stream) {
  const std::string path = g_dir + "/" + name;
  FILE* f = fopen(path.c_str(), "wb");
  if (!f) {
    perror(path.c_str());
    exit(1);
  }
  const uint8_t control = static_cast<uint8_t>(g_count++ % 8);  // threads 1..4, cross-check on half
  fwrite(&control, 1, 1, f);
  fwrite(stream.data(), 1, stream.size(), f);
  fclose(f);
}

// Float32 bits of N(0, sigma^2) values, narrowed by truncation: the codec is
// lossless on bits, the seeds only need the skewed exponents of real tensors.
std::vector<uint8_t> tensor_bytes(fmt::DType d, uint64_t numel, bool random, std::mt19937_64& rng) {
  std::vector<uint8_t> b(numel * fmt::elem_size(d));
  if (random || !fmt::is_coded(d)) {
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (d == fmt::DType::Bool)
      for (auto& x : b) x &= 1;  // valid bools only: the decoder rejects any other byte
    return b;
  }
  std::normal_distribution<float> normal(0.0f, d == fmt::DType::BFloat16 ? 0.02f : 1.0f);
  for (uint64_t i = 0; i < numel; ++i) {
    const float v = normal(rng);
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t sign = u >> 31, exp = (u >> 23) & 0xff, man = u & 0x7fffff;
    auto narrow = [&](int ebits, int mbits) -> uint32_t {  // sign | exponent (clamped) | mantissa
      const int emax = (1 << ebits) - 2, bias = (1 << (ebits - 1)) - 1;
      int e = static_cast<int>(exp) - 127 + bias;
      e = e < 0 ? 0 : e > emax ? emax : e;
      return sign << (ebits + mbits) | static_cast<uint32_t>(e) << mbits | man >> (23 - mbits);
    };
    switch (d) {
      case fmt::DType::BFloat16: b[2 * i] = u >> 16 & 0xff; b[2 * i + 1] = u >> 24; break;
      case fmt::DType::Float32: memcpy(&b[4 * i], &u, 4); break;
      case fmt::DType::Float16: {
        const uint32_t h = narrow(5, 10);
        b[2 * i] = h & 0xff;
        b[2 * i + 1] = h >> 8;
        break;
      }
      case fmt::DType::Float8E4M3FN: b[i] = static_cast<uint8_t>(narrow(4, 3)); break;
      case fmt::DType::Float8E5M2: b[i] = static_cast<uint8_t>(narrow(5, 2)); break;
      default: break;
    }
  }
  return b;
}

void add_stream(const std::string& name, fmt::DType d, std::vector<int64_t> shape, fmt::Codec codec, bool random,
                int block_log2, std::mt19937_64& rng, int lanes = 0) {
  uint64_t numel = 1;
  for (int64_t s : shape) numel *= static_cast<uint64_t>(s);
  fmt::Header h = fmt::plan_header(d, numel, shape.data(), static_cast<int>(shape.size()), codec);
  if (block_log2 && h.codec != fmt::Codec::Raw) h.block_log2 = static_cast<uint8_t>(block_log2);
  if (lanes && h.codec == fmt::Codec::Rans) h.lanes = static_cast<uint8_t>(lanes);
  const std::vector<uint8_t> in = tensor_bytes(d, numel, random, rng);
  std::vector<uint8_t> out(fmt::max_stream_bytes(h));
  out.resize(cpu_compress(in.data(), h, out.data(), 1));
  // A seed that does not decode to its input would make the fuzzer start from noise.
  fmt::Header got;
  std::vector<uint8_t> back(in.size());
  if (fmt::parse_header(out.data(), out.size(), out.size(), &got) != fmt::ParseError::Ok ||
      cpu_decompress(out.data(), got, back.data(), 1) != 0 || back != in) {
    fprintf(stderr, "fuzz_seeds: %s does not round-trip\n", name.c_str());
    exit(1);
  }
  write_seed(name, out);
}

void write_dict(const char* path) {
  FILE* f = fopen(path, "w");
  if (!f) {
    perror(path);
    exit(1);
  }
  auto entry = [&](const char* name, const std::vector<uint8_t>& bytes) {
    fprintf(f, "%s=\"", name);
    for (uint8_t c : bytes) fprintf(f, "\\x%02x", c);
    fprintf(f, "\"\n");
  };
  const std::vector<uint8_t> magic(fmt::kMagic, fmt::kMagic + 4);
  std::vector<uint8_t> mv = magic;
  mv.push_back(fmt::kVersion);
  entry("magic", magic);
  entry("magic_version", mv);
  for (int lg = fmt::kMinBlockLog2; lg <= fmt::kMaxBlockLog2; ++lg)
    for (int lanes : {fmt::kLanes, fmt::kWideLanes})
      entry(("params_log2_" + std::to_string(lg) + "_" + std::to_string(lanes)).c_str(),
            {static_cast<uint8_t>(lg), static_cast<uint8_t>(fmt::kProbBits), static_cast<uint8_t>(lanes), 0});
  entry("params_raw", {0, static_cast<uint8_t>(fmt::kProbBits), static_cast<uint8_t>(fmt::kLanes), 0});
  for (uint8_t c = 0; c < fmt::kNumCodecs; ++c)
    for (uint8_t d : {1, 2, 3, 4, 5, 10})
      entry(("dtype_codec_" + std::to_string(d) + "_" + std::to_string(c)).c_str(), {d, c});
  entry("state_low", {0x00, 0x00, 0x01, 0x00});                   // rANS final state L = 2^16
  entry("prob_scale", {0x90, 0x00});                              // varint 4096
  entry("u64_16", {0x10, 0, 0, 0, 0, 0, 0, 0});                   // one minimal segment
  entry("u64_max", {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff});
  fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: fuzz_seeds OUTDIR DICT [STREAM...]\n");
    return 2;
  }
  g_dir = argv[1];
  write_dict(argv[2]);
  std::mt19937_64 rng(20240917);
  const struct {
    fmt::DType d;
    const char* name;
  } coded[] = {{fmt::DType::BFloat16, "bf16"}, {fmt::DType::Float16, "fp16"}, {fmt::DType::Float32, "fp32"},
               {fmt::DType::Float8E4M3FN, "e4m3"}, {fmt::DType::Float8E5M2, "e5m2"}};
  for (const auto& c : coded)
    for (fmt::Codec codec : {fmt::Codec::Rans, fmt::Codec::Fixed}) {
      const std::string base = std::string(c.name) + (codec == fmt::Codec::Rans ? "_rans" : "_fixed");
      add_stream(base + "_1", c.d, {1}, codec, false, 0, rng);
      add_stream(base + "_77", c.d, {7, 11}, codec, false, 0, rng);
      add_stream(base + "_300_random", c.d, {300}, codec, true, 0, rng);
      // Several blocks (the multi-threaded path): 2^10-symbol blocks; fp8 packs two elements per symbol.
      const int64_t per_block = (c.d == fmt::DType::Float8E4M3FN || c.d == fmt::DType::Float8E5M2) ? 2048 : 1024;
      add_stream(base + "_3blocks", c.d, {3 * per_block - 5}, codec, false, 10, rng);
      add_stream(base + "_2blocks_random", c.d, {2, per_block}, codec, true, 10, rng);
      add_stream(base + "_default_blocks", c.d, {5000}, codec, false, 0, rng);
      if (codec == fmt::Codec::Rans) {  // 64 lanes: a partial last row, several blocks, random data
        add_stream(base + "_wide_77", c.d, {7, 11}, codec, false, 0, rng, fmt::kWideLanes);
        add_stream(base + "_wide_3blocks", c.d, {3 * per_block - 5}, codec, false, 10, rng, fmt::kWideLanes);
        add_stream(base + "_wide_2blocks_random", c.d, {2, per_block}, codec, true, 10, rng, fmt::kWideLanes);
      }
    }
  add_stream("bf16_scalar", fmt::DType::BFloat16, {}, fmt::Codec::Rans, false, 0, rng);
  add_stream("bf16_codec_raw", fmt::DType::BFloat16, {40}, fmt::Codec::Raw, false, 0, rng);
  add_stream("fp16_empty", fmt::DType::Float16, {0, 4}, fmt::Codec::Rans, false, 0, rng);
  add_stream("fp32_deep_shape", fmt::DType::Float32, {2, 1, 3, 1, 2, 1, 1, 2}, fmt::Codec::Rans, false, 0, rng);
  add_stream("int32_raw", fmt::DType::Int32, {33, 3}, fmt::Codec::Rans, false, 0, rng);
  add_stream("uint8_raw", fmt::DType::UInt8, {17}, fmt::Codec::Rans, false, 0, rng);
  add_stream("float64_raw", fmt::DType::Float64, {2, 3}, fmt::Codec::Rans, false, 0, rng);
  add_stream("bool_raw", fmt::DType::Bool, {9}, fmt::Codec::Rans, false, 0, rng);
  add_stream("complex128_raw", fmt::DType::Complex128, {2}, fmt::Codec::Rans, false, 0, rng);
  add_stream("e4m3fnuz_raw", fmt::DType::Float8E4M3FNUZ, {5}, fmt::Codec::Rans, false, 0, rng);
  for (int i = 3; i < argc; ++i) {
    FILE* f = fopen(argv[i], "rb");
    if (!f) {
      perror(argv[i]);
      return 1;
    }
    std::vector<uint8_t> s;
    for (int ch; (ch = fgetc(f)) != EOF;) s.push_back(static_cast<uint8_t>(ch));
    fclose(f);
    std::string name = argv[i];
    name = "file_" + name.substr(name.find_last_of('/') + 1);
    write_seed(name, s);
  }
  printf("fuzz_seeds: %d seeds in %s, dictionary %s\n", g_count, g_dir.c_str(), argv[2]);
  return 0;
}
