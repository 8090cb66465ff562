// Neutral names over the CUDA and HIP runtimes, for the launchers. Small
// inline wrappers where the two signatures differ; both branches compile in CI.
#pragma once
#include "platform.h"

#if defined(PZ_CUDA) || defined(PZ_HIP)
namespace pz::rt {

#if defined(PZ_HIP)
using Stream = hipStream_t;
using Error = hipError_t;
constexpr Error kSuccess = hipSuccess;
inline const char* error_string(Error e) { return hipGetErrorString(e); }
inline Error last_error() { return hipGetLastError(); }
inline Error memset_async(void* p, int v, size_t n, Stream s) { return hipMemsetAsync(p, v, n, s); }
inline Error memcpy_h2d_async(void* d, const void* h, size_t n, Stream s) {
  return hipMemcpyAsync(d, h, n, hipMemcpyHostToDevice, s);
}
inline Error current_device(int* d) { return hipGetDevice(d); }
inline Error warp_size(int dev, int* v) { return hipDeviceGetAttribute(v, hipDeviceAttributeWarpSize, dev); }
inline Error sm_count(int dev, int* v) { return hipDeviceGetAttribute(v, hipDeviceAttributeMultiprocessorCount, dev); }
inline Error max_smem_optin(int dev, int* v) {
  return hipDeviceGetAttribute(v, hipDeviceAttributeMaxSharedMemoryPerBlock, dev);
}
template <class K>
inline Error occupancy(int* ctas, K kernel, int threads, size_t smem) {
  return hipOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kernel, threads, smem);
}
template <class K>
inline Error set_max_dynamic_smem(K kernel, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// The fabric engine's staging ring: pinned host slots, a copy stream, events.
using Event = hipEvent_t;
constexpr Error kNotReady = hipErrorNotReady;
inline Error set_device(int d) { return hipSetDevice(d); }
inline Error memcpy_async(void* d, const void* s, size_t n, Stream st) {
  return hipMemcpyAsync(d, s, n, hipMemcpyDefault, st);
}
inline Error stream_create(Stream* s) { return hipStreamCreateWithFlags(s, hipStreamNonBlocking); }
inline Error stream_destroy(Stream s) { return hipStreamDestroy(s); }
inline Error event_create(Event* e) { return hipEventCreateWithFlags(e, hipEventDisableTiming); }
inline Error event_destroy(Event e) { return hipEventDestroy(e); }
inline Error event_record(Event e, Stream s) { return hipEventRecord(e, s); }
inline Error event_query(Event e) { return hipEventQuery(e); }
inline Error stream_wait(Stream s, Event e) { return hipStreamWaitEvent(s, e, 0); }
inline Error host_alloc(void** p, size_t n) { return hipHostMalloc(p, n, hipHostMallocPortable); }
inline Error host_free(void* p) { return hipHostFree(p); }
#else
using Stream = cudaStream_t;
using Error = cudaError_t;
constexpr Error kSuccess = cudaSuccess;
inline const char* error_string(Error e) { return cudaGetErrorString(e); }
inline Error last_error() { return cudaGetLastError(); }
inline Error memset_async(void* p, int v, size_t n, Stream s) { return cudaMemsetAsync(p, v, n, s); }
inline Error memcpy_h2d_async(void* d, const void* h, size_t n, Stream s) {
  return cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s);
}
inline Error current_device(int* d) { return cudaGetDevice(d); }
inline Error warp_size(int dev, int* v) { return cudaDeviceGetAttribute(v, cudaDevAttrWarpSize, dev); }
inline Error sm_count(int dev, int* v) { return cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, dev); }
inline Error max_smem_optin(int dev, int* v) {
  return cudaDeviceGetAttribute(v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
}
template <class K>
inline Error occupancy(int* ctas, K kernel, int threads, size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kernel, threads, smem);
}
template <class K>
inline Error set_max_dynamic_smem(K kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// The fabric engine's staging ring: pinned host slots, a copy stream, events.
using Event = cudaEvent_t;
constexpr Error kNotReady = cudaErrorNotReady;
inline Error set_device(int d) { return cudaSetDevice(d); }
inline Error memcpy_async(void* d, const void* s, size_t n, Stream st) {
  return cudaMemcpyAsync(d, s, n, cudaMemcpyDefault, st);
}
inline Error stream_create(Stream* s) { return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking); }
inline Error stream_destroy(Stream s) { return cudaStreamDestroy(s); }
inline Error event_create(Event* e) { return cudaEventCreateWithFlags(e, cudaEventDisableTiming); }
inline Error event_destroy(Event e) { return cudaEventDestroy(e); }
inline Error event_record(Event e, Stream s) { return cudaEventRecord(e, s); }
inline Error event_query(Event e) { return cudaEventQuery(e); }
inline Error stream_wait(Stream s, Event e) { return cudaStreamWaitEvent(s, e, 0); }
inline Error host_alloc(void** p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocPortable); }
inline Error host_free(void* p) { return cudaFreeHost(p); }
#endif

}  // namespace pz::rt
#endif
