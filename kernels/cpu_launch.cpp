// CPU entry points: the multi-threaded driver over the shared per-block code.
#include <string>
#include <thread>

#include "launch.h"
#include "portable_zip/cpu_codec.h"

namespace pz {

static thread_local std::string g_error;

void set_last_error(const char* what, const char* detail) {
  g_error = what;
  if (detail && *detail) g_error += std::string(": ") + detail;
}

const char* last_error_message() { return g_error.c_str(); }

static int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

uint64_t cpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, int threads) {
  return cpu::compress(in, h, out, resolve_threads(threads));
}

uint32_t cpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, int threads) {
  return cpu::decompress(in, h, out, resolve_threads(threads));
}

}  // namespace pz
