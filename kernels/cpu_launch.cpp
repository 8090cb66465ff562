// CPU entry points: the multi-threaded driver over the shared per-block code.
#include <string>
#include <thread>

#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif

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

void cpu_advise_huge_pages(void* p, uint64_t n) {
#if defined(MADV_HUGEPAGE)
  // The 2 MiB pages wholly inside [p, p + n): a hint, so a failure changes nothing.
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t z = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (z > a) madvise(reinterpret_cast<void*>(a), z - a, MADV_HUGEPAGE);
#else
  (void)p, (void)n;
#endif
}

}  // namespace pz
