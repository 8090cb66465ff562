// Every lane-level intrinsic, for CUDA, HIP (wave32 and wave64) and the host.
// The only file allowed to hold inline asm.
//
// The codec works on "groups" of fmt::kLanes = 32 lanes, a format constant.
// A wave64 holds two groups: ballots are shifted by (lane & 32) and shuffles
// use width 32, so wave32 and wave64 hardware produce identical streams.
#pragma once
#include <stdint.h>

#include "platform.h"

namespace pz {

constexpr int kGroupLanes = 32;  // must equal fmt::kLanes (checked in format.h)

PZ_HOST_DEVICE PZ_FORCE_INLINE int popc32(uint32_t v) {
#if defined(PZ_DEVICE_COMPILE)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// High 32 bits of a 32x32-bit product.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(PZ_DEVICE_COMPILE)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes hi:lo (CUDA's
// and HIP's __byte_perm, selector nibbles 0-7 only): one PRMT on NVIDIA.
PZ_HOST_DEVICE PZ_FORCE_INLINE uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t sel) {
#if defined(PZ_DEVICE_COMPILE)
  return __byte_perm(lo, hi, sel);
#else
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
#endif
}

#if defined(PZ_CUDA) || defined(PZ_HIP)

// Hardware lane mask: 64-bit on HIP (wave64 or wave32), 32-bit on CUDA.
#if defined(PZ_HIP)
using lanemask_t = uint64_t;
#else
using lanemask_t = uint32_t;
#endif

PZ_DEVICE PZ_FORCE_INLINE int hw_lane() {
#if defined(PZ_HIP)
  return static_cast<int>(__lane_id());
#else
  return static_cast<int>(threadIdx.x & 31);  // NVIDIA warps are always 32 wide
#endif
}

// Lane index inside the 32-lane group.
PZ_DEVICE PZ_FORCE_INLINE int group_lane() { return hw_lane() & (kGroupLanes - 1); }

PZ_DEVICE PZ_FORCE_INLINE lanemask_t ballot(bool pred) {
#if defined(PZ_HIP)
  return __ballot(pred);
#else
  return __ballot_sync(0xffffffffu, pred);
#endif
}

// Ballot restricted to this lane's 32-lane group, as a 32-bit mask.
PZ_DEVICE PZ_FORCE_INLINE uint32_t group_ballot(bool pred) {
  const lanemask_t b = ballot(pred);
#if defined(PZ_WARP_SIZE) && PZ_WARP_SIZE == 64
  return static_cast<uint32_t>(b >> (hw_lane() & 32));
#else
  return static_cast<uint32_t>(b);
#endif
}

// 1-based index of the lowest set bit, 0 for none.
PZ_DEVICE PZ_FORCE_INLINE int ffs32(uint32_t v) { return __ffs(static_cast<int>(v)); }

// Lanes of the group below this one.
PZ_DEVICE PZ_FORCE_INLINE uint32_t group_lanemask_lt() { return (1u << group_lane()) - 1u; }

PZ_DEVICE PZ_FORCE_INLINE uint32_t group_shfl_xor(uint32_t v, int mask) {
#if defined(PZ_HIP)
  return static_cast<uint32_t>(__shfl_xor(static_cast<int>(v), mask, kGroupLanes));
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, kGroupLanes);
#endif
}

PZ_DEVICE PZ_FORCE_INLINE uint32_t group_shfl(uint32_t v, int src_lane) {
#if defined(PZ_HIP)
  return static_cast<uint32_t>(__shfl(static_cast<int>(v), src_lane, kGroupLanes));
#else
  return __shfl_sync(0xffffffffu, v, src_lane, kGroupLanes);
#endif
}

PZ_DEVICE PZ_FORCE_INLINE uint64_t group_sum64(uint64_t v) {
#pragma unroll
  for (int m = 1; m < kGroupLanes; m <<= 1) {
    const uint32_t lo = group_shfl_xor(static_cast<uint32_t>(v), m);
    const uint32_t hi = group_shfl_xor(static_cast<uint32_t>(v >> 32), m);
    v += (static_cast<uint64_t>(hi) << 32) | lo;
  }
  return v;
}

// Barrier across the group with shared-memory visibility. __syncwarp does not
// exist before ROCm 7, so HIP gets fence + wave barrier + fence.
PZ_DEVICE PZ_FORCE_INLINE void group_sync() {
#if defined(PZ_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  __syncwarp();
#endif
}

// Scoped atomics: the scope is always spelled out.
enum class Scope { Block, Device, System };

template <Scope S>
PZ_DEVICE PZ_FORCE_INLINE uint32_t atomic_add(uint32_t* p, uint32_t v) {
#if defined(PZ_HIP)
  constexpr int scope = S == Scope::Block    ? __HIP_MEMORY_SCOPE_WORKGROUP
                        : S == Scope::Device ? __HIP_MEMORY_SCOPE_AGENT
                                             : __HIP_MEMORY_SCOPE_SYSTEM;
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, scope);
#else
  if constexpr (S == Scope::Block) return atomicAdd_block(p, v);
  else if constexpr (S == Scope::Device) return atomicAdd(p, v);
  else return atomicAdd_system(p, v);
#endif
}

template <Scope S>
PZ_DEVICE PZ_FORCE_INLINE uint32_t atomic_or(uint32_t* p, uint32_t v) {
#if defined(PZ_HIP)
  constexpr int scope = S == Scope::Block    ? __HIP_MEMORY_SCOPE_WORKGROUP
                        : S == Scope::Device ? __HIP_MEMORY_SCOPE_AGENT
                                             : __HIP_MEMORY_SCOPE_SYSTEM;
  return __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, scope);
#else
  if constexpr (S == Scope::Block) return atomicOr_block(p, v);
  else if constexpr (S == Scope::Device) return atomicOr(p, v);
  else return atomicOr_system(p, v);
#endif
}

// Device-scope acquire load / release store of a 64-bit word, for the
// decoupled look-back between blocks of one launch.
PZ_DEVICE PZ_FORCE_INLINE uint64_t load_acquire_device(const uint64_t* p) {
#if defined(PZ_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#else
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

PZ_DEVICE PZ_FORCE_INLINE void store_release_device(uint64_t* p, uint64_t v) {
#if defined(PZ_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
#else
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Hint: pull the line holding p into L1 (no value is read).
PZ_DEVICE PZ_FORCE_INLINE void prefetch_l1(const void* p) {
#if defined(PZ_HIP)
  __builtin_prefetch(p);
#else
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// A cached 4-byte load (its line lands in L1) kept in place: the caller
// consumes the value later, off its chains.
PZ_DEVICE PZ_FORCE_INLINE uint32_t touch_l1(const void* p) {
#if defined(PZ_HIP)
  return *static_cast<const uint32_t*>(p);
#else
  uint32_t v;
  asm volatile("ld.global.ca.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
#endif
}

#endif  // PZ_CUDA || PZ_HIP

}  // namespace pz
