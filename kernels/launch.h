// Plain C++ API of the compiled library: raw pointers, 64-bit sizes, a
// stream, error codes. No torch, no Python.
#pragma once
#include <stdint.h>

#include "portable_zip/format.h"
#include "portable_zip/gpu_runtime.h"  // the staging copies a transport uses
#include "portable_zip/status.h"       // return codes and last_error_message()

namespace pz {

// CPU (every build). threads <= 0 means one per hardware thread.
uint64_t cpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, int threads);
uint32_t cpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, int threads);
// Asks the kernel to back a fresh buffer with transparent huge pages (Linux,
// where THP is "madvise"): first touches then fault 2 MiB at a time.
void cpu_advise_huge_pages(void* p, uint64_t n);
// cpu_compress into a buffer it allocates, holding exactly the stream's pages
// (*total bytes of stream in *mapped bytes); null on failure. Free with
// cpu_release_mapped(p, *mapped).
uint8_t* cpu_compress_mapped(const uint8_t* in, const fmt::Header& h, int threads, uint64_t* total, uint64_t* mapped);
void cpu_release_mapped(uint8_t* p, uint64_t mapped);

// Weight deltas (delta.h, kernels/delta_cpu.cpp); threads < 1 means 1.
// cpu_delta_encode returns a malloc'd stream of *total bytes (free()), null
// on failure; cpu_delta_apply returns a delta::Error (0: rebuilt and verified).
uint64_t cpu_delta_checksum(const uint8_t* p, uint64_t nbytes, int threads);
uint8_t* cpu_delta_encode(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, int threads,
                          uint64_t* total);
uint32_t cpu_delta_apply(uint8_t* base, fmt::DType d, uint64_t numel, const uint8_t* stream, uint64_t len,
                         int threads);

// GPU (whichever vendor runtime device_api.h loaded; device < 0 means the
// calling thread's current device). Workspace is device memory the launcher
// clears on the stream; decompress ORs DecodeError bits into *err (device).
// gpu_compress and gpu_decompress take raw (codec 0) streams too: a kernel
// copies the payload and computes or checks its checksums.
// max_sms > 0 limits the persistent grid to that many SMs' worth of CTAs.
// The workspace depends on the device (its spill slots are as many as the
// CTAs that fit on it at once), so the query loads the kernel.
int gpu_compress_workspace_bytes(const fmt::Header& h, int device, uint64_t* bytes);
// A batch of tensors of one dtype and codec in one launch (16-byte-aligned
// workspace; with more than one tensor, 16-byte-aligned inputs).
int gpu_compress_batch_workspace_bytes(const fmt::Header* hs, int n, int device, uint64_t* bytes);
int gpu_compress_batch(const uint8_t* const* ins, const fmt::Header* hs, uint8_t* const* outs, int n, void* workspace,
                       void* stream, int device, int max_sms);
int gpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, void* workspace, void* stream, int device,
                 int max_sms);
int gpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, void* stream, int device,
                   int max_sms);
// Decodes whose headers the kernel parses: the host waits for nothing. Job j
// decodes stream ins[j] (in_lens[j] bytes, 16-byte aligned) into outs[j],
// described by expects[j] (plan_header of the output's dtype and shape), and
// ORs DecodeError bits into *errs[j] (device), kErrHeader and kErrMismatch
// included. One launch for jobs of one coded dtype, or of dtypes never coded;
// a single rANS job gets a second, its fast path (gpu_params.h, DecompressLaunch).
// Workspace: gpu_decode_batch_workspace_bytes(n) bytes, 16-byte aligned.
uint64_t gpu_decode_batch_workspace_bytes(int n);
int gpu_decode_batch(const uint8_t* const* ins, const uint64_t* in_lens, uint8_t* const* outs, uint32_t* const* errs,
                     const fmt::Header* expects, int n, void* workspace, void* stream, int device, int max_sms);
int gpu_device_info(int device, int* warp_size, int* sm_count);
// Weight deltas on the GPU (delta_gpu.h). Checksum: adds the two sums of
// nbytes at p into sums[0..1] (device u32s). ws: gpu_delta_workspace_bytes.
// Encode: plan (then read ws's total and changed: delta_gpu.h), write into out
// (the total's bytes; the host writes the header). Apply: table (checks the
// stream's table into ws, err bits), then decode dry (write false) and, once
// the host has checked, writing. err: a device u32 of kDeltaErr bits.
uint64_t gpu_delta_workspace_bytes(uint64_t numel);
int gpu_delta_checksum(const uint8_t* p, uint64_t nbytes, uint32_t* sums, void* stream, int device, int max_sms);
int gpu_delta_plan(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, uint64_t* ws,
                   void* stream, int device, int max_sms);
int gpu_delta_write(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, uint8_t* out,
                    uint64_t* ws, void* stream, int device, int max_sms);
int gpu_delta_table(const uint8_t* stream_bytes, const uint8_t* head, uint64_t* ws, uint32_t* err, void* stream,
                    int device);
int gpu_delta_decode(uint8_t* base, const uint8_t* stream_bytes, const uint8_t* head, uint64_t* ws, uint32_t* err,
                     bool write, void* stream, int device, int max_sms);

// The launch report: what this process's GPU codec launches (every kernel
// above, both of a decode batch's) used since the last reset, so a test can
// prove an SM budget reaches each launch from the codec's own account.
// max_sms: the most SMs a grid was sized for (max_sms capped to the device's
// SM count; the SM count without a budget). max_grid_sms: the most SMs' worth
// of CTAs a grid held (its CTAs over the kernel's CTAs per SM, rounded up),
// never above max_sms. Thread-safe; reset reads and zeroes each field at once
// (a launch racing the call lands in this report or the next, field by field).
struct LaunchReport {
  uint64_t launches, max_grid, max_sms, max_grid_sms;
};
LaunchReport gpu_launch_report(bool reset);

}  // namespace pz
