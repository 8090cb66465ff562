// libFuzzer harness for the CPU weight-delta decoder (delta.h, ci/fuzz runs
// it beside libfuzz_decode.cpp with ASan and fatal UBSan).
//
// Input: [control byte][delta stream]. The base is a fixed pattern of the
// header's element count (at most 1 MiB). Control bit 0 picks 1 or 3
// threads; with bit 1 the harness re-signs the stream first (header, body and
// base checksums recomputed: a forger's stream) so mutations reach the table
// and block decoders rather than stopping at a checksum.
//
// Beyond ASan/UBSan, a run aborts when:
//  - apply returns an error code outside delta::Error, or changes the base
//    while rejecting the stream before the rebuild;
//  - a stream whose only fault is its target checksum (re-signed with the
//    checksum of what apply rebuilt) does not apply to the same bytes;
//  - re-encoding (base, rebuilt) gives a stream that does not rebuild it.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "launch.h"
#include "portable_zip/delta.h"

using namespace pz;

namespace {

constexpr uint64_t kMaxBaseBytes = 1ull << 20;  // larger numels only slow the run down

[[noreturn]] void fail(const char* what) {
  fprintf(stderr, "libfuzz_delta: %s\n", what);
  abort();
}

// The body is what the header's total names: a stream may sit in a longer
// buffer (apply accepts trailing bytes and does not read them).
void resign(std::vector<uint8_t>& s, uint64_t base_sum, uint64_t target_sum) {
  fmt::put_u64(s.data() + 32, base_sum);
  fmt::put_u64(s.data() + 40, target_sum);
  const uint64_t total = fmt::get_u64(s.data() + delta::kTotalOffset);
  const uint64_t end = total >= delta::kHeaderBytes && total < s.size() ? total : s.size();
  fmt::put_u32(s.data() + delta::kBodySumOffset,
               delta::body_checksum(cpu_delta_checksum(s.data() + delta::kHeaderBytes, end - delta::kHeaderBytes, 1)));
  fmt::put_u32(s.data() + delta::kHeaderSumOffset, delta::header_checksum(s.data()));
}

uint32_t apply(std::vector<uint8_t>& base, const delta::Header& h, const std::vector<uint8_t>& s, int threads) {
  const uint32_t e = cpu_delta_apply(base.data(), h.dtype, h.numel, s.data(), s.size(), threads);
  if (e > static_cast<uint32_t>(delta::Error::TargetMismatch)) fail("unknown error code");
  return e;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + static_cast<size_t>(delta::kHeaderBytes)) return 0;
  const uint8_t control = data[0];
  const int threads = control & 1 ? 3 : 1;
  std::vector<uint8_t> s(data + 1, data + size);
  // The fields apply reads before any check, as Python sizes the base from them.
  const fmt::DType d = static_cast<fmt::DType>(s[5]);
  const uint64_t numel = fmt::get_u64(s.data() + 16);
  const int w = s[5] < static_cast<uint8_t>(fmt::DType::Count) ? delta::width_bits(d) : 0;
  if (!w || numel > kMaxBaseBytes / (w / 8)) return 0;
  std::vector<uint8_t> base0(numel * (w / 8));
  for (uint64_t i = 0; i < base0.size(); ++i) base0[i] = static_cast<uint8_t>(i * 131 ^ (i >> 9) ^ 0x5a);
  const uint64_t base_sum = cpu_delta_checksum(base0.data(), base0.size(), 1);
  if (control & 2) resign(s, base_sum, fmt::get_u64(s.data() + 40));
  delta::Header h;
  h.dtype = d, h.numel = numel;
  std::vector<uint8_t> base = base0;
  const uint32_t e = apply(base, h, s, threads);
  const bool rebuilt = e == 0 || e == static_cast<uint32_t>(delta::Error::TargetMismatch);
  if (!rebuilt && base != base0) fail("a rejected stream changed the base");
  if (!rebuilt) return 0;
  // The rebuilt bytes, now as the stream's declared target: must apply exactly.
  resign(s, base_sum, cpu_delta_checksum(base.data(), base.size(), 1));
  std::vector<uint8_t> again = base0;
  if (apply(again, h, s, 4 - threads) != 0 || again != base) fail("a re-signed stream does not rebuild the same bytes");
  uint64_t total = 0;
  uint8_t* enc = cpu_delta_encode(base0.data(), base.data(), d, numel, threads, &total);
  if (!enc) fail("encode failed");
  std::vector<uint8_t> s2(enc, enc + total);
  free(enc);
  if (total > delta::max_stream_bytes(d, numel)) fail("encode wrote more than max_stream_bytes");
  std::vector<uint8_t> third = base0;
  if (apply(third, h, s2, threads) != 0 || third != base) fail("encode -> apply does not round-trip");
  return 0;
}
