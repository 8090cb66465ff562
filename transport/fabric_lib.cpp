#include "fabric_lib.h"

#include <dlfcn.h>
#include <rdma/fi_ext.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace pz::fabric {
namespace {

std::string g_error;
Lib g_lib;
int (*g_getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*, struct fi_info**) = nullptr;
int (*g_open_fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*) = nullptr;

// Loading libfabric (Debian's pulls in libinfinipath through its psm
// provider) or a provider it loads lazily in fi_getinfo may install handlers
// for SIGINT, SIGTERM, SIGSEGV, ... that end the process at once: no
// KeyboardInterrupt, no finally, no user's SIGTERM handler. Every signal's
// disposition is saved before such a call and any the library changed is put back.
class KeepSignals {
 public:
  KeepSignals() {
    for (int s = 1; s < NSIG; ++s)
      if (s != SIGKILL && s != SIGSTOP) ok_[s] = sigaction(s, nullptr, &saved_[s]) == 0;
  }
  ~KeepSignals() {
    for (int s = 1; s < NSIG; ++s) {
      struct sigaction now{};
      if (!ok_[s] || sigaction(s, nullptr, &now) != 0) continue;
      if (!same(now, saved_[s])) sigaction(s, &saved_[s], nullptr);
    }
  }
  KeepSignals(const KeepSignals&) = delete;
  KeepSignals& operator=(const KeepSignals&) = delete;

 private:
  // Compared member by member: libc copies sa_mask beyond the kernel's
  // signals from uninitialised memory, and adds SA_RESTORER itself.
  static bool same(const struct sigaction& a, const struct sigaction& b) {
    if (a.sa_handler != b.sa_handler || ((a.sa_flags ^ b.sa_flags) & ~kLibcFlags)) return false;
    for (int s = 1; s < NSIG; ++s)
      if (sigismember(&a.sa_mask, s) != sigismember(&b.sa_mask, s)) return false;
    return true;
  }
#ifdef SA_RESTORER
  static constexpr int kLibcFlags = SA_RESTORER;
#else
  static constexpr int kLibcFlags = 0;
#endif
  struct sigaction saved_[NSIG]{};
  bool ok_[NSIG]{};
};

// rxm (libfabric 1.17) tears down a peer's connection, when the peer closes
// or dies, inside a progress call (a queue read, a send that connects) and
// says so only in its log ("shutdown conn"), while that peer's queued
// rendezvous requests still point at the connection: a receive that matches
// one later crashes. A logger counts those notices per thread, so the engine
// learns of the teardown in the very call that did it (conn_closes_here).
// Every other message goes where libfabric's own logger sends it.
thread_local uint64_t t_conn_closes = 0;
struct fi_ops_log g_default_log{};

bool rxm_shutdown_notice(const struct fi_provider* prov, enum fi_log_level level, enum fi_log_subsys subsys) {
  return level == FI_LOG_INFO && subsys == FI_LOG_EP_CTRL && prov && prov->name &&
         std::strcmp(prov->name, "ofi_rxm") == 0;
}

int log_enabled(const struct fi_provider* prov, enum fi_log_level level, enum fi_log_subsys subsys, uint64_t flags) {
  return rxm_shutdown_notice(prov, level, subsys) || g_default_log.enabled(prov, level, subsys, flags);
}

void log_message(const struct fi_provider* prov, enum fi_log_level level, enum fi_log_subsys subsys, const char* func,
                 int line, const char* msg) {
  const bool notice = rxm_shutdown_notice(prov, level, subsys);
  if (notice && std::strncmp(msg, "shutdown conn", 13) == 0) ++t_conn_closes;
  if (!notice || g_default_log.enabled(prov, level, subsys, 0)) g_default_log.log(prov, level, subsys, func, line, msg);
}

struct fi_ops_log g_log_ops = {sizeof(struct fi_ops_log), log_enabled, nullptr, log_message};
struct fid_logging g_log_fid{};

// Best effort: a library without the logging import (< 1.17) keeps its logger.
void watch_shutdowns(void* h, uint32_t version) {
  using Open = int (*)(uint32_t, const char*, void*, size_t, uint64_t, struct fid**, void*);
  const auto open = reinterpret_cast<Open>(dlsym(h, "fi_open"));  // FABRIC_1.5
  if (!open) return;
  struct fid* logging = nullptr;
  if (open(version, "logging", nullptr, 0, 0, &logging, nullptr) != 0 || !logging) return;
  const auto* current = reinterpret_cast<struct fid_logging*>(logging)->ops;
  if (current && current->enabled && current->log) {
    g_default_log = *current;
    g_log_fid.fid.fclass = FI_CLASS_LOG;
    g_log_fid.ops = &g_log_ops;
    if (fi_import_fid(logging, &g_log_fid.fid, 0) != 0) g_default_log = {};
  }
  fi_close(logging);
}

int getinfo_keeping_signals(uint32_t v, const char* node, const char* service, uint64_t flags,
                            const struct fi_info* hints, struct fi_info** info) {
  KeepSignals keep;
  return g_getinfo(v, node, service, flags, hints, info);
}

int open_fabric_keeping_signals(struct fi_fabric_attr* attr, struct fid_fabric** fabric, void* context) {
  KeepSignals keep;
  return g_open_fabric(attr, fabric, context);
}

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
  // libinfinipath (the psm provider's) installs its crash handlers unless
  // told not to; a user's own setting wins. The guard below catches the rest.
  setenv("IPATH_NO_BACKTRACE", "1", 0);
  KeepSignals keep;
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
  const bool ok = bind(h, &g_getinfo, "fi_getinfo") && bind(h, &g_lib.freeinfo, "fi_freeinfo") &&
                  bind(h, &g_lib.dupinfo, "fi_dupinfo") && bind(h, &g_open_fabric, "fi_fabric") &&
                  bind(h, &g_lib.strerror, "fi_strerror") && bind(h, &g_lib.version, "fi_version");
  if (!ok) {
    g_error = g_lib.path + " lacks a libfabric entry point (fi_getinfo, fi_fabric, ...): not a libfabric >= 1.9?";
    return;
  }
  g_lib.getinfo = getinfo_keeping_signals;
  g_lib.open_fabric = open_fabric_keeping_signals;
  const uint32_t v = g_lib.version();
  if (FI_MAJOR(v) < 1 || (FI_MAJOR(v) == 1 && FI_MINOR(v) < 9))
    g_error = g_lib.path + " is libfabric " + std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v)) +
              "; portable_zip needs 1.9 or newer";
  else
    watch_shutdowns(h, v);
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

uint64_t conn_closes_here() { return t_conn_closes; }

std::string err_text(int rc) {
  if (load_error().empty()) return std::string(g_lib.strerror(rc < 0 ? -rc : rc)) + " (" + std::to_string(rc) + ")";
  return "error " + std::to_string(rc);
}

}  // namespace pz::fabric
