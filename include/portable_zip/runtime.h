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
#endif

}  // namespace pz::rt
#endif
