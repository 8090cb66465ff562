#include "fabric_lib.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace pz::fabric {
namespace {

std::string g_error;
Lib g_lib;

template <class F>
bool bind(void* h, F* fn, const char* name) {
  // FABRIC_1.3 (libfabric 1.9+) has the fi_info layout these headers declare;
  // fall back to the default version for private builds without symbol versions.
  void* p = dlvsym(h, name, "FABRIC_1.3");
  if (!p) p = dlvsym(h, name, "FABRIC_1.0");
  if (!p) p = dlsym(h, name);
  *fn = reinterpret_cast<F>(p);
  return p != nullptr;
}

void load() {
  // PZ_FABRIC_LIBRARY names a file (an EFA install's /opt/amazon/efa/lib/libfabric.so.1).
  const char* forced = std::getenv("PZ_FABRIC_LIBRARY");
  const char* names[] = {forced, "libfabric.so.1", "/opt/amazon/efa/lib/libfabric.so.1",
                         "/opt/amazon/efa/lib64/libfabric.so.1"};
  std::string tried;
  void* h = nullptr;
  for (const char* n : names) {
    if (!n || !*n) continue;
    h = dlopen(n, RTLD_NOW | RTLD_LOCAL);
    if (h) {
      g_lib.path = n;
      break;
    }
    const char* why = dlerror();
    tried += std::string("\n  ") + n + ": " + (why ? why : "not found");
    if (forced && n == forced) break;  // a forced path is the only one tried
  }
  if (!h) {
    g_error = "libfabric is not available (transport=\"fabric\" loads libfabric.so.1 at run time)." + tried +
              "\nInstall it (Debian/Ubuntu: apt-get install libfabric1; AWS EFA: the EFA installer's "
              "/opt/amazon/efa), or point PZ_FABRIC_LIBRARY at libfabric.so.1.";
    return;
  }
  const bool ok = bind(h, &g_lib.getinfo, "fi_getinfo") && bind(h, &g_lib.freeinfo, "fi_freeinfo") &&
                  bind(h, &g_lib.dupinfo, "fi_dupinfo") && bind(h, &g_lib.open_fabric, "fi_fabric") &&
                  bind(h, &g_lib.strerror, "fi_strerror") && bind(h, &g_lib.version, "fi_version");
  if (!ok) {
    g_error = g_lib.path + " lacks a libfabric entry point (fi_getinfo, fi_fabric, ...): not a libfabric >= 1.9?";
    return;
  }
  const uint32_t v = g_lib.version();
  if (FI_MAJOR(v) < 1 || (FI_MAJOR(v) == 1 && FI_MINOR(v) < 9))
    g_error = g_lib.path + " is libfabric " + std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v)) +
              "; portable_zip needs 1.9 or newer";
}

std::once_flag g_once;

}  // namespace

std::string load_error() {
  std::call_once(g_once, load);
  return g_error;
}

const Lib& lib() {
  const std::string e = load_error();
  if (!e.empty()) throw std::runtime_error(e);
  return g_lib;
}

std::string err_text(int rc) {
  if (load_error().empty()) return std::string(g_lib.strerror(rc < 0 ? -rc : rc)) + " (" + std::to_string(rc) + ")";
  return "error " + std::to_string(rc);
}

}  // namespace pz::fabric
