// Force-included (-include) only when clang builds AMD code objects with
// -nogpulib: the distribution's ROCm device libraries (Debian ships 5.2) have
// no ISA files for gfx942, gfx11 or gfx12, so nothing is linked from them.
// HIP's headers call six of their functions; each is a clang builtin or
// plain arithmetic, defined here with the headers' own signatures.
#pragma once
#include <hip/hip_runtime.h>

namespace pz::amdgcn {
// The kernel's dispatch packet (hsa_kernel_dispatch_packet_t): workgroup
// sizes are 16-bit fields at bytes 4, 6, 8; grid sizes 32-bit at 12, 16, 20.
__device__ __attribute__((always_inline)) inline uint32_t workgroup_size(uint dim) {
  const auto* p = static_cast<const uint16_t*>(__builtin_amdgcn_dispatch_ptr());
  return dim < 3 ? p[2 + dim] : 1u;
}
__device__ __attribute__((always_inline)) inline uint32_t grid_size(uint dim) {
  const auto* p = static_cast<const uint32_t*>(__builtin_amdgcn_dispatch_ptr());
  return dim < 3 ? p[3 + dim] : 1u;
}
}  // namespace pz::amdgcn

extern "C" __device__ __attribute__((const, always_inline)) inline size_t __ockl_get_local_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workitem_id_x() : dim == 1 ? __builtin_amdgcn_workitem_id_y()
                                                     : dim == 2 ? __builtin_amdgcn_workitem_id_z() : 0u;
}
extern "C" __device__ __attribute__((const, always_inline)) inline size_t __ockl_get_group_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workgroup_id_x() : dim == 1 ? __builtin_amdgcn_workgroup_id_y()
                                                      : dim == 2 ? __builtin_amdgcn_workgroup_id_z() : 0u;
}
extern "C" __device__ __attribute__((const, always_inline)) inline size_t __ockl_get_local_size(uint dim) {
  return pz::amdgcn::workgroup_size(dim);
}
extern "C" __device__ __attribute__((const, always_inline)) inline size_t __ockl_get_num_groups(uint dim) {
  const uint32_t w = pz::amdgcn::workgroup_size(dim);
  return (pz::amdgcn::grid_size(dim) + w - 1) / w;
}
extern "C" __device__ __attribute__((const, always_inline)) inline uint __ockl_mul_hi_u32(uint x, uint y) {
  return static_cast<uint>((static_cast<uint64_t>(x) * y) >> 32);
}

// A fence's order and scope must be constants for the builtin; every caller
// passes constants, so after inlining one branch remains. The flags (which
// address spaces) are not narrowed: the fence covers all of them.
#define PZ_FENCE_AT(order)                                                                        \
  switch (scope) {                                                                                \
    case __memory_scope_work_item: return;                                                        \
    case __memory_scope_sub_group: __builtin_amdgcn_fence(order, "wavefront"); return;            \
    case __memory_scope_work_group: __builtin_amdgcn_fence(order, "workgroup"); return;           \
    case __memory_scope_device: __builtin_amdgcn_fence(order, "agent"); return;                   \
    default: __builtin_amdgcn_fence(order, ""); return;                                           \
  }
extern "C" __device__ __attribute__((always_inline)) inline void __atomic_work_item_fence(
    __cl_mem_fence_flags, __memory_order order, __memory_scope scope) {
  switch (order) {
    case __memory_order_relaxed: return;
    case __memory_order_acquire: PZ_FENCE_AT(__ATOMIC_ACQUIRE)
    case __memory_order_release: PZ_FENCE_AT(__ATOMIC_RELEASE)
    case __memory_order_acq_rel: PZ_FENCE_AT(__ATOMIC_ACQ_REL)
    default: PZ_FENCE_AT(__ATOMIC_SEQ_CST)
  }
}
#undef PZ_FENCE_AT
