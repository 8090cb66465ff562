// libFuzzer harness for the CPU decoder (ci/fuzz builds and runs it with
// -fsanitize=fuzzer,address,undefined and fatal UBSan).
//
// Input: [control byte][stream bytes]. The stream goes through the decode
// entry exactly as pz.decompress does on the CPU: parse_header on a copy of
// the head bytes against the whole buffer length, an output buffer sized from
// the parsed header (at most 64 MiB), then cpu_decompress. The control byte picks the thread
// count (bits 0-1: 1..4 threads) and, with bit 2, a second decode with another
// thread count into a differently filled buffer.
//
// Beyond ASan/UBSan, a run aborts when:
//  - a decode returns error bits outside DecodeError;
//  - two thread counts disagree on success, or on the decoded bytes (which
//    also catches an output byte that a successful decode never writes);
//  - a successfully decoded tensor does not survive compress -> parse -> decode
//    bit for bit with the stream's own dtype, shape and codec.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "launch.h"
#include "portable_zip/block.h"

using namespace pz;

namespace {

// A caller sizes its output tensor from the header before decoding; beyond
// this it could not allocate either, so the harness declines the stream.
constexpr uint64_t kMaxOutputBytes = 64ull << 20;
constexpr uint32_t kKnownErrors = kKnownDecodeErrors;  // every bit block.h defines

[[noreturn]] void fail(const char* what, const fmt::Header& h) {
  fprintf(stderr, "libfuzz_decode: %s (dtype %d codec %d ndim %d numel %llu total %llu block_log2 %d)\n", what,
          static_cast<int>(h.dtype), static_cast<int>(h.codec), h.ndim, static_cast<unsigned long long>(h.numel),
          static_cast<unsigned long long>(h.total_bytes), h.block_log2);
  abort();
}

// The Python path: head = the first min(len, MAX_HEADER_BYTES) bytes, copied
// out of the stream, parsed against the stream's full length.
bool parse_like_python(const uint8_t* stream, uint64_t len, fmt::Header* h) {
  std::vector<uint8_t> head(stream, stream + std::min<uint64_t>(len, fmt::kMaxHeaderBytes));
  return fmt::parse_header(head.data(), head.size(), len, h) == fmt::ParseError::Ok;
}

uint32_t decode(const uint8_t* stream, const fmt::Header& h, std::vector<uint8_t>& out, int threads) {
  const uint32_t err = cpu_decompress(stream, h, out.data(), threads);
  if (err & ~kKnownErrors) fail("decode returned unknown error bits", h);
  return err;
}

void check_round_trip(const fmt::Header& h, const std::vector<uint8_t>& decoded) {
  const fmt::Header plan = fmt::plan_header(h.dtype, h.numel, h.shape, h.ndim, h.codec);
  std::vector<uint8_t> stream(fmt::max_stream_bytes(plan));
  const uint64_t total = cpu_compress(decoded.data(), plan, stream.data(), 1);
  if (total > stream.size()) fail("compress wrote past max_stream_bytes", h);
  stream.resize(total);  // exact size, so ASan sees any read past the stream
  fmt::Header again;
  if (!parse_like_python(stream.data(), stream.size(), &again)) fail("re-compressed stream fails parse_header", h);
  if (again.dtype != h.dtype || again.numel != h.numel || again.ndim != h.ndim ||
      !std::equal(h.shape, h.shape + h.ndim, again.shape))
    fail("re-compressed stream has another dtype or shape", h);
  std::vector<uint8_t> out(decoded.size(), 0x5a);
  if (decode(stream.data(), again, out, 1)) fail("re-compressed stream fails to decode", h);
  if (out != decoded) fail("decode(compress(decode(s))) != decode(s)", h);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t control = data[0];
  const uint8_t* stream = data + 1;  // libFuzzer's copy ends exactly at data + size
  const uint64_t len = size - 1;
  fmt::Header h;
  if (!parse_like_python(stream, len, &h)) return 0;
  if (h.total_bytes > len) fail("parse_header accepted a total beyond the stream", h);
  const uint64_t out_bytes = h.numel * static_cast<uint64_t>(fmt::elem_size(h.dtype));
  if (out_bytes > kMaxOutputBytes) return 0;

  // Bytes past total_bytes (a padded GPU buffer, say) are not the stream's:
  // decode from an exact-size copy so ASan flags any read beyond the total.
  const std::vector<uint8_t> exact(stream, stream + h.total_bytes);
  const int threads = 1 + (control & 3);
  std::vector<uint8_t> out(out_bytes, 0x00);
  const uint32_t err = decode(exact.data(), h, out, threads);
  if (control & 4) {
    const int other = threads == 1 ? 2 : 1;
    std::vector<uint8_t> out2(out_bytes, 0xff);
    const uint32_t err2 = decode(exact.data(), h, out2, other);
    if ((err == 0) != (err2 == 0)) fail("thread counts disagree on whether the stream is valid", h);
    if (!err && out != out2) fail("thread counts (or output fills) give different bytes", h);
  }
  if (!err) check_round_trip(h, out);
  return 0;
}
