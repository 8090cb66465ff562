// CPU entry points: the multi-threaded driver over the shared per-block code.
#include <cstdlib>
#include <string>
#include <thread>

#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#include <unistd.h>
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

constexpr uint64_t kHugePage = uint64_t{2} << 20;

void cpu_advise_huge_pages(void* p, uint64_t n) {
#if defined(MADV_HUGEPAGE)
  // The 2 MiB pages wholly inside [p, p + n): a hint, so a failure changes nothing.
  const uintptr_t a = fmt::align_up(reinterpret_cast<uintptr_t>(p), kHugePage);
  const uintptr_t z = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHugePage - 1);
  if (z > a) madvise(reinterpret_cast<void*>(a), z - a, MADV_HUGEPAGE);
#else
  (void)p, (void)n;
#endif
}

// Compress into an exact-size mapping: a fresh anonymous mapping of the
// stream's worst-case size (2 MiB-aligned, huge pages asked for), whose tail
// past the stream is unmapped in place once the size is known. A trimmed
// stream thus costs no copy (at 64 MiB the copy was 8% of a one-thread
// compress and 23% of a two-thread one).
uint8_t* cpu_compress_mapped(const uint8_t* in, const fmt::Header& h, int threads, uint64_t* total, uint64_t* mapped) {
  const uint64_t cap = fmt::max_stream_bytes(h);
  struct Release {  // frees the buffer if the encoder throws (std::bad_alloc)
    uint8_t* p;
    uint64_t n;
    ~Release() {
      if (p) cpu_release_mapped(p, n);
    }
  };
#if __has_include(<sys/mman.h>) && defined(MAP_ANONYMOUS)
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t want = fmt::align_up(cap, page), len = want + kHugePage;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    set_last_error("compress: mapping the output buffer failed", std::to_string(len).c_str());
    return nullptr;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(m), a = fmt::align_up(base, kHugePage);
  if (a > base) munmap(m, a - base);
  if (base + len > a + want) munmap(reinterpret_cast<void*>(a + want), base + len - (a + want));
  uint8_t* out = reinterpret_cast<uint8_t*>(a);
  cpu_advise_huge_pages(out, want);
  Release guard{out, want};
  *total = cpu_compress(in, h, out, threads);
  guard.p = nullptr;
  *mapped = fmt::align_up(*total > 0 ? *total : 1, page);  // a zero-length mapping cannot be kept
  if (*mapped < want) munmap(out + *mapped, want - *mapped);
  return out;
#else
  uint8_t* out = static_cast<uint8_t*>(std::malloc(cap > 0 ? cap : 1));
  if (!out) {
    set_last_error("compress: allocating the output buffer failed", std::to_string(cap).c_str());
    return nullptr;
  }
  Release guard{out, cap};
  *total = cpu_compress(in, h, out, threads);
  guard.p = nullptr;
  if (uint8_t* fit = static_cast<uint8_t*>(std::realloc(out, *total > 0 ? *total : 1))) out = fit;  // may copy
  *mapped = *total;
  return out;
#endif
}

void cpu_release_mapped(uint8_t* p, uint64_t mapped) {
#if __has_include(<sys/mman.h>) && defined(MAP_ANONYMOUS)
  munmap(p, mapped);
#else
  (void)mapped;
  std::free(p);
#endif
}

}  // namespace pz
