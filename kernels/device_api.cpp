// The vendor runtime behind device_api.h: a table of entry points bound
// with dlsym from libcuda.so.1 or libamdhip64.so.{7,6,5}. Prototypes are
// written out here (handles as void*, results as int) so no vendor header is
// needed; the enum values used are ABI: CUDA's are fixed, and HIP keeps
// hipDeviceAttribute_t's numbering (retired entries become "Unused").
#include "device_api.h"

#include <dlfcn.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

namespace pz::dev {
namespace {

constexpr int kLoaderError = -1;  // not the vendor's: the message is in g_detail
thread_local std::string g_detail;

int loader_error(const std::string& why) {
  g_detail = why;
  return kLoaderError;
}

using Ptr = unsigned long long;  // CUdeviceptr
struct Table {
  // Both vendors.
  int (*init)(unsigned);
  int (*module_load_data)(void**, const void*);
  int (*module_get_function)(void**, void*, const char*);
  int (*occupancy)(int*, void*, int, size_t);
  int (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
  int (*device_attribute)(int*, int, int);
  int (*event_query)(void*);
  int (*event_record)(void*, void*);
  int (*stream_wait_event)(void*, void*, unsigned);
  int (*stream_create)(void**, unsigned);
  int (*stream_destroy)(void*);
  int (*event_create)(void**, unsigned);
  int (*event_destroy)(void*);
  int (*host_alloc)(void**, size_t, unsigned);
  int (*host_free)(void*);
  // CUDA's driver API.
  int (*cu_device_get)(int*, int);
  int (*cu_primary_ctx_retain)(void**, int);
  int (*cu_ctx_get_current)(void**);
  int (*cu_ctx_set_current)(void*);
  int (*cu_ctx_get_device)(int*);
  int (*cu_func_set_attribute)(void*, int, int);
  int (*cu_memset_d8_async)(Ptr, unsigned char, size_t, void*);
  int (*cu_memcpy_async)(Ptr, Ptr, size_t, void*);
  int (*cu_get_error_string)(int, const char**);
  // HIP.
  int (*hip_set_device)(int);
  int (*hip_get_device)(int*);
  int (*hip_memset_async)(void*, int, size_t, void*);
  int (*hip_memcpy_async)(void*, const void*, size_t, int, void*);
  const char* (*hip_get_error_string)(int);
};

// CUDA driver enums.
constexpr int kCuWarpSize = 10, kCuSmCount = 16, kCuMaxSmemOptin = 97, kCuCcMajor = 75, kCuCcMinor = 76;
constexpr int kCuFuncMaxDynamicSmem = 8;
constexpr unsigned kCuStreamNonBlocking = 1, kCuEventDisableTiming = 2, kCuHostAllocPortable = 1;
// HIP enums (hipDeviceAttribute_t, hipMemcpyKind, flags).
constexpr int kHipWarpSize = 87, kHipSmCount = 63, kHipMaxSmemPerBlock = 74, kHipMemcpyDefault = 4;
constexpr unsigned kHipStreamNonBlocking = 1, kHipEventDisableTiming = 2, kHipHostMallocPortable = 1;

struct Module {
  void* handle = nullptr;
  std::string image;  // the file it came from
  std::unordered_map<std::string, Function> functions;
};

struct State {
  std::mutex mu;
  Vendor vendor = Vendor::None;
  void* lib = nullptr;
  Table t{};
  std::string code_dir;
  std::map<int, void*> contexts;  // CUDA primary contexts, retained for the process
  std::map<int, Module> modules;
};

State& state() {
  static State* s = new State;  // never destroyed: kernels may run during interpreter exit
  return *s;
}

// Binds entry points by name, collecting the names the library lacks.
struct Binder {
  void* lib;
  std::string missing;
  template <class F>
  bool operator()(const char* name, F* f, bool report = true) {
    *f = reinterpret_cast<F>(dlsym(lib, name));
    if (!*f && report) missing += std::string(missing.empty() ? "" : ", ") + name;
    return *f != nullptr;
  }
};

std::string bind_cuda(void* l, Table& t) {
  Binder b{l, ""};
  b("cuInit", &t.init);
  b("cuModuleLoadData", &t.module_load_data);
  b("cuModuleGetFunction", &t.module_get_function);
  b("cuOccupancyMaxActiveBlocksPerMultiprocessor", &t.occupancy);
  b("cuLaunchKernel", &t.launch);
  b("cuDeviceGetAttribute", &t.device_attribute);
  b("cuEventQuery", &t.event_query);
  b("cuEventRecord", &t.event_record);
  b("cuStreamWaitEvent", &t.stream_wait_event);
  b("cuStreamCreate", &t.stream_create);
  b("cuStreamDestroy_v2", &t.stream_destroy);
  b("cuEventCreate", &t.event_create);
  b("cuEventDestroy_v2", &t.event_destroy);
  b("cuMemHostAlloc", &t.host_alloc);
  b("cuMemFreeHost", &t.host_free);
  b("cuDeviceGet", &t.cu_device_get);
  b("cuDevicePrimaryCtxRetain", &t.cu_primary_ctx_retain);
  b("cuCtxGetCurrent", &t.cu_ctx_get_current);
  b("cuCtxSetCurrent", &t.cu_ctx_set_current);
  b("cuCtxGetDevice", &t.cu_ctx_get_device);
  b("cuFuncSetAttribute", &t.cu_func_set_attribute);
  b("cuMemsetD8Async", &t.cu_memset_d8_async);
  b("cuMemcpyAsync", &t.cu_memcpy_async);
  b("cuGetErrorString", &t.cu_get_error_string);
  return b.missing;
}

std::string bind_hip(void* l, Table& t) {
  Binder b{l, ""};
  b("hipInit", &t.init);
  b("hipModuleLoadData", &t.module_load_data);
  b("hipModuleGetFunction", &t.module_get_function);
  b("hipModuleOccupancyMaxActiveBlocksPerMultiprocessor", &t.occupancy);
  b("hipModuleLaunchKernel", &t.launch);
  b("hipDeviceGetAttribute", &t.device_attribute);
  b("hipEventQuery", &t.event_query);
  b("hipEventRecord", &t.event_record);
  b("hipStreamWaitEvent", &t.stream_wait_event);
  b("hipStreamCreateWithFlags", &t.stream_create);
  b("hipStreamDestroy", &t.stream_destroy);
  b("hipEventCreateWithFlags", &t.event_create);
  b("hipEventDestroy", &t.event_destroy);
  b("hipHostFree", &t.host_free);
  b("hipSetDevice", &t.hip_set_device);
  b("hipGetDevice", &t.hip_get_device);
  b("hipMemsetAsync", &t.hip_memset_async);
  b("hipMemcpyAsync", &t.hip_memcpy_async);
  b("hipGetErrorString", &t.hip_get_error_string);
  // hipHostMalloc is deprecated in ROCm 7 in favour of hipHostAlloc (same arguments).
  if (!b("hipHostMalloc", &t.host_alloc, false)) b("hipHostAlloc", &t.host_alloc);
  return b.missing;
}

bool ends_with(const std::string& s, const char* tail) {
  const std::string t(tail);
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

// stdio, not iostreams: a source build on the H200 image (GCC in /opt/gcc)
// crashed inside iostream's locale code, and the static libstdc++'s filebuf
// calls fstat64, which glibc exports only from 2.33 on (the wheel targets 2.28).
bool read_file(const std::string& path, std::string* bytes) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) return false;
  bytes->clear();
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) bytes->append(buf, n);
  const bool ok = !ferror(f);
  fclose(f);
  return ok;
}

// The number after a prefix ("sm_90.cubin" -> 90), or -1.
int arch_number(const std::string& s, size_t at) {
  int v = 0, digits = 0;
  for (; at < s.size() && s[at] >= '0' && s[at] <= '9' && digits < 4; ++at, ++digits) v = 10 * v + (s[at] - '0');
  return digits ? v : -1;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

}  // namespace

// A clang offload bundle: "__CLANG_OFFLOAD_BUNDLE__", a u64 count, then
// offset, size, id length and id per entry.
std::vector<std::string> bundle_targets(const std::string& b) {
  std::vector<std::string> ids;
  const std::string magic = "__CLANG_OFFLOAD_BUNDLE__";
  if (b.compare(0, magic.size(), magic) != 0 || b.size() < magic.size() + 8) return ids;
  auto u64 = [&](size_t at, uint64_t* v) {
    if (at + 8 > b.size()) return false;
    *v = 0;
    for (int i = 7; i >= 0; --i) *v = (*v << 8) | static_cast<uint8_t>(b[at + i]);
    return true;
  };
  uint64_t n = 0, off = 0, size = 0, len = 0;
  size_t at = magic.size();
  if (!u64(at, &n)) return ids;
  at += 8;
  for (uint64_t i = 0; i < n && i < 256; ++i, at += 24 + len) {
    if (!u64(at, &off) || !u64(at + 8, &size) || !u64(at + 16, &len) || len > b.size() || at + 24 + len > b.size())
      break;
    const std::string id = b.substr(at + 24, len);
    const size_t k = id.find("--");  // hipv4-amdgcn-amd-amdhsa--gfx942
    if (id.rfind("host-", 0) != 0) ids.push_back(k == std::string::npos ? id : id.substr(k + 2));
  }
  return ids;
}

namespace {

// Loads this device's module (the calling thread's current device).
int load_module(State& s, int device, Module* m) {
  const std::vector<std::string> files = code_files(s.vendor, s.code_dir);
  std::string image, picked;
  if (s.vendor == Vendor::Cuda) {
    int major = 0, minor = 0;
    int rc = s.t.device_attribute(&major, kCuCcMajor, device);
    if (!rc) rc = s.t.device_attribute(&minor, kCuCcMinor, device);
    if (rc) return rc;
    picked = pick_cuda_image(files, major, minor);
    if (picked.empty())
      return loader_error("no NVIDIA device code for sm_" + std::to_string(major) + std::to_string(minor) + " in " +
                          s.code_dir + " (it holds: " + joined(files) + ")");
    if (!read_file(s.code_dir + "/" + picked, &image)) return loader_error("cannot read " + s.code_dir + "/" + picked);
    if (ends_with(picked, ".ptx")) image.push_back('\0');  // PTX is loaded as a C string
    int lr = s.t.module_load_data(&m->handle, image.data());
    if (lr && !ends_with(picked, ".ptx")) {  // e.g. a driver too old for the cubin: JIT the PTX instead
      std::vector<std::string> ptx;
      for (const auto& f : files)
        if (ends_with(f, ".ptx")) ptx.push_back(f);
      const std::string best = pick_cuda_image(ptx, major, minor);
      if (!best.empty() && read_file(s.code_dir + "/" + best, &image)) {
        image.push_back('\0');
        m->image = best;
        if (!s.t.module_load_data(&m->handle, image.data())) return 0;
      }
    }
    m->image = picked;
    if (lr) {
      return loader_error("loading " + picked + " for sm_" + std::to_string(major) + std::to_string(minor) + ": " +
                          error_text(lr) + " (the driver may be older than the code's CUDA 12 toolchain needs)");
    }
    return 0;
  }
  for (const auto& f : files)
    if (ends_with(f, ".hipfb") || ends_with(f, ".co")) picked = f;
  if (picked.empty()) return loader_error("no AMD device code in " + s.code_dir + " (it holds: " + joined(files) + ")");
  if (!read_file(s.code_dir + "/" + picked, &image)) return loader_error("cannot read " + s.code_dir + "/" + picked);
  m->image = picked;
  const int rc = s.t.module_load_data(&m->handle, image.data());
  if (rc)
    return loader_error("loading " + picked + ": " + error_text(rc) + "; it holds code for " +
                        joined(bundle_targets(image)) + ", none of which this GPU and ROCm version accept");
  return 0;
}

}  // namespace

const char* vendor_name(Vendor v) { return v == Vendor::Cuda ? "cuda" : v == Vendor::Hip ? "hip" : "none"; }

Vendor vendor() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.vendor;
}

std::string load(Vendor v, const std::string& code_dir) {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.vendor == v) return "";
  if (s.vendor != Vendor::None)
    return std::string("the ") + vendor_name(s.vendor) + " runtime is already loaded; one process uses one vendor";
  std::vector<std::string> names;
  if (v == Vendor::Cuda) names = {"libcuda.so.1"};
  else if (v == Vendor::Hip) names = {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"};
  else return "no GPU vendor named";
  if (const char* forced = getenv("PZ_GPU_LIBRARY"); forced && *forced) names = {forced};
  std::string errors;
  void* lib = nullptr;
  for (const auto& n : names) {
    // A name without a slash matches a library already loaded under that
    // soname (torch's own HIP runtime): one runtime, one set of streams.
    lib = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib) break;
    const char* e = dlerror();
    errors += (errors.empty() ? "" : "; ") + (e ? std::string(e) : n);
  }
  if (!lib) {
    if (v == Vendor::Cuda)
      return "the NVIDIA driver library libcuda.so.1 could not be loaded (" + errors +
             "): install the NVIDIA driver (525 or newer)";
    return "the HIP runtime (libamdhip64.so.7, .6 or .5) could not be loaded (" + errors +
           "): install ROCm 6 or 7, or put its lib directory on LD_LIBRARY_PATH";
  }
  Table t{};
  const std::string missing = v == Vendor::Cuda ? bind_cuda(lib, t) : bind_hip(lib, t);
  if (!missing.empty()) {
    dlclose(lib);
    return std::string("the ") + vendor_name(v) + " runtime lacks " + missing + " (too old?)";
  }
  if (const int rc = t.init(0)) {
    const char* text = nullptr;
    if (v == Vendor::Cuda) t.cu_get_error_string(rc, &text);
    else text = t.hip_get_error_string(rc);
    const std::string why = std::string(vendor_name(v)) + " did not initialize: " + (text ? text : "error") +
                            " (error " + std::to_string(rc) + "): no usable GPU, or a driver the runtime cannot use";
    dlclose(lib);
    return why;
  }
  s.lib = lib, s.t = t, s.vendor = v, s.code_dir = code_dir;
  return "";
}

std::vector<std::string> code_files(Vendor v, const std::string& code_dir) {
  std::vector<std::string> out;
  DIR* d = opendir(code_dir.c_str());
  if (!d) return out;
  while (const dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    const bool cuda = (n.rfind("sm_", 0) == 0 && ends_with(n, ".cubin")) ||
                      (n.rfind("compute_", 0) == 0 && ends_with(n, ".ptx"));
    const bool hip = ends_with(n, ".hipfb");
    if ((v == Vendor::Cuda && cuda) || (v == Vendor::Hip && hip)) out.push_back(n);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string pick_cuda_image(const std::vector<std::string>& files, int major, int minor) {
  const int want = 10 * major + minor;
  std::string cubin, ptx;
  int cubin_cc = -1, ptx_cc = -1;
  for (const auto& f : files) {
    int cc = -1;
    if (f.rfind("sm_", 0) == 0 && ends_with(f, ".cubin")) {
      cc = arch_number(f, 3);
      // SASS runs on its own major only, at the same or a higher minor.
      if (cc / 10 == major && cc <= want && cc > cubin_cc) cubin = f, cubin_cc = cc;
    } else if (f.rfind("compute_", 0) == 0 && ends_with(f, ".ptx")) {
      cc = arch_number(f, 8);
      if (cc >= 0 && cc <= want && cc > ptx_cc) ptx = f, ptx_cc = cc;  // the driver compiles PTX forward
    }
  }
  return !cubin.empty() ? cubin : ptx;
}

int use_device(int device) {
  State& s = state();
  if (s.vendor == Vendor::Hip) return s.t.hip_set_device(device);
  if (s.vendor != Vendor::Cuda) return loader_error("no GPU runtime is loaded");
  void* cur = nullptr;
  void* want = nullptr;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.contexts.find(device);
    if (it == s.contexts.end()) {
      int dev = 0;
      int rc = s.t.cu_device_get(&dev, device);
      if (!rc) rc = s.t.cu_primary_ctx_retain(&want, dev);
      if (rc) return rc;
      s.contexts[device] = want;
    } else {
      want = it->second;
    }
  }
  if (const int rc = s.t.cu_ctx_get_current(&cur)) return rc;
  return cur == want ? 0 : s.t.cu_ctx_set_current(want);
}

int current_device(int* device) {
  State& s = state();
  if (s.vendor == Vendor::Hip) return s.t.hip_get_device(device);
  if (s.vendor != Vendor::Cuda) return loader_error("no GPU runtime is loaded");
  void* cur = nullptr;
  if (const int rc = s.t.cu_ctx_get_current(&cur)) return rc;
  if (!cur) {  // a thread that has not touched the GPU: device 0, as CUDA's runtime does
    *device = 0;
    return 0;
  }
  return s.t.cu_ctx_get_device(device);
}

int attribute(int device, Attr a, int* value) {
  State& s = state();
  if (s.vendor == Vendor::None) return loader_error("no GPU runtime is loaded");
  const bool cu = s.vendor == Vendor::Cuda;
  const int code = a == Attr::WarpSize ? (cu ? kCuWarpSize : kHipWarpSize)
                 : a == Attr::SmCount ? (cu ? kCuSmCount : kHipSmCount)
                                      : (cu ? kCuMaxSmemOptin : kHipMaxSmemPerBlock);
  return s.t.device_attribute(value, code, device);
}

int kernel(int device, const std::string& name, Function* f) {
  State& s = state();
  if (s.vendor == Vendor::None) return loader_error("no GPU runtime is loaded");
  if (const int rc = use_device(device)) return rc;
  std::lock_guard<std::mutex> lk(s.mu);
  Module& m = s.modules[device];
  if (!m.handle) {
    if (const int rc = load_module(s, device, &m)) {
      s.modules.erase(device);
      return rc;
    }
  }
  auto it = m.functions.find(name);
  if (it != m.functions.end()) {
    *f = it->second;
    return 0;
  }
  void* fn = nullptr;
  if (const int rc = s.t.module_get_function(&fn, m.handle, name.c_str()))
    return loader_error("the device code has no kernel " + name + " (" + error_text(rc) + "): a stale build?");
  m.functions.emplace(name, fn);
  *f = fn;
  return 0;
}

std::string loaded_image(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  auto it = s.modules.find(device);
  return it == s.modules.end() ? "" : it->second.image;
}

int occupancy(Function f, int threads, size_t smem, int* ctas) { return state().t.occupancy(ctas, f, threads, smem); }

int set_max_dynamic_smem(Function f, int bytes) {
  State& s = state();
  // AMD has no opt-in: a workgroup may use all of its LDS.
  return s.vendor == Vendor::Cuda ? s.t.cu_func_set_attribute(f, kCuFuncMaxDynamicSmem, bytes) : 0;
}

int launch(Function f, unsigned grid, unsigned block, size_t smem, Stream st, void* params) {
  void* args[] = {params};
  return state().t.launch(f, grid, 1, 1, block, 1, 1, static_cast<unsigned>(smem), st, args, nullptr);
}

int memset_async(void* p, int v, size_t n, Stream st) {
  State& s = state();
  if (s.vendor == Vendor::Cuda)
    return s.t.cu_memset_d8_async(reinterpret_cast<Ptr>(p), static_cast<unsigned char>(v), n, st);
  return s.t.hip_memset_async(p, v, n, st);
}

int memcpy_async(void* dst, const void* src, size_t n, Stream st) {
  State& s = state();
  if (s.vendor == Vendor::Cuda)
    return s.t.cu_memcpy_async(reinterpret_cast<Ptr>(dst), reinterpret_cast<Ptr>(src), n, st);
  return s.t.hip_memcpy_async(dst, src, n, kHipMemcpyDefault, st);
}

int stream_create(Stream* st) {
  State& s = state();
  return s.t.stream_create(st, s.vendor == Vendor::Cuda ? kCuStreamNonBlocking : kHipStreamNonBlocking);
}
int stream_destroy(Stream st) { return state().t.stream_destroy(st); }
int event_create(Event* e) {
  State& s = state();
  return s.t.event_create(e, s.vendor == Vendor::Cuda ? kCuEventDisableTiming : kHipEventDisableTiming);
}
int event_destroy(Event e) { return state().t.event_destroy(e); }
int event_record(Event e, Stream st) { return state().t.event_record(e, st); }
int event_query(Event e) { return state().t.event_query(e); }
int stream_wait(Stream st, Event e) { return state().t.stream_wait_event(st, e, 0); }
int host_alloc(void** p, size_t n) {
  State& s = state();
  return s.t.host_alloc(p, n, s.vendor == Vendor::Cuda ? kCuHostAllocPortable : kHipHostMallocPortable);
}
int host_free(void* p) { return state().t.host_free(p); }

std::string error_text(int code) {
  if (code == kLoaderError) return g_detail;
  State& s = state();
  const char* text = nullptr;
  if (s.vendor == Vendor::Cuda && s.t.cu_get_error_string) s.t.cu_get_error_string(code, &text);
  if (s.vendor == Vendor::Hip && s.t.hip_get_error_string) text = s.t.hip_get_error_string(code);
  return std::string(text ? text : "error") + " (" + vendor_name(s.vendor) + " error " + std::to_string(code) + ")";
}

}  // namespace pz::dev
