// Two glibc symbols newer than 2.28 that the static libstdc++ of a toolchain
// built on a newer glibc refers to, defined inside the extension (hidden), so
// that _C's references bind here and none is left for the loader to find in
// glibc (cmake/glibc_floor.cmake says why; manylinux_2_28 wheels).
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

extern "C" {

// glibc 2.32. libstdc++ skips atomic reference counting while it is nonzero;
// 0 keeps the atomics on, as once any thread has started (and as before 2.32,
// in any process linked with libpthread, which Python is).
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

// glibc 2.36. std::random_device's entropy source: libstdc++'s random_device
// comes in with its std::string members, and nothing in portable_zip uses it.
__attribute__((visibility("hidden"))) uint32_t arc4random(void) noexcept {
  uint32_t v;
  if (getentropy(&v, sizeof v) != 0) abort();  // glibc 2.25
  return v;
}

}  // extern "C"
