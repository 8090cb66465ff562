// The GPU vendor's runtime, loaded at run time: NVIDIA's driver API
// (libcuda.so.1) or AMD's HIP runtime (libamdhip64.so.7, .6 or .5). Nothing
// links either, so one build imports on any machine, the kernels come from
// device-code files beside the extension (cubins and PTX, or an AMD code
// object bundle), and the same build serves whichever vendor torch runs on.
//
// Every call returns 0 or the vendor's error code (both vendors number
// "not ready" 600); error_text() turns a code into the vendor's words.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

namespace pz::dev {

enum class Vendor : int { None = 0, Cuda = 1, Hip = 2 };
using Stream = void*;
using Event = void*;
using Function = void*;
constexpr int kNotReady = 600;

// Loads the vendor's library (idempotent; a second vendor is refused) and
// records the directory of device code. Returns "" or why it failed, naming
// the library and what to install. PZ_GPU_LIBRARY names another library.
std::string load(Vendor v, const std::string& code_dir);
Vendor vendor();
const char* vendor_name(Vendor v);

// The device code files for a vendor, as the loader would consider them
// (e.g. "sm_90.cubin", "compute_90.ptx", "amdgcn.hipfb").
std::vector<std::string> code_files(Vendor v, const std::string& code_dir);
// Which CUDA image the loader picks for compute capability major.minor from
// these file names: the cubin of the same major with the highest minor not
// above it, else the newest PTX not above it, else "" (no usable code).
std::string pick_cuda_image(const std::vector<std::string>& files, int major, int minor);

// The gfx targets of an AMD code-object bundle (clang offload bundle format).
std::vector<std::string> bundle_targets(const std::string& bundle);

int use_device(int device);     // current on this thread (CUDA: the primary context)
int current_device(int* device);
enum class Attr { WarpSize, SmCount, MaxSmemPerBlock };
int attribute(int device, Attr a, int* value);
// A kernel of the device module, loaded for this device on first use.
int kernel(int device, const std::string& name, Function* f);
std::string loaded_image(int device);  // the file its module came from ("" before the first kernel)
int occupancy(Function f, int threads, size_t smem, int* ctas_per_sm);
int set_max_dynamic_smem(Function f, int bytes);
int launch(Function f, unsigned grid, unsigned block, size_t smem, Stream s, void* params);

int memset_async(void* p, int v, size_t n, Stream s);
int memcpy_async(void* dst, const void* src, size_t n, Stream s);  // any direction (unified addressing)
int stream_create(Stream* s);
int stream_destroy(Stream s);
int event_create(Event* e);
int event_destroy(Event e);
int event_record(Event e, Stream s);
int event_query(Event e);
int stream_wait(Stream s, Event e);
int host_alloc(void** p, size_t n);  // pinned, portable across devices
int host_free(void* p);
std::string error_text(int code);

}  // namespace pz::dev
