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

// Hardware lane mask: 64-bit on HIP (wave64 or wave32) and in the wave64
// emulation, 32-bit on CUDA.
#if defined(PZ_HIP) || defined(PZ_WAVE_EMULATION)
using lanemask_t = uint64_t;
#else
using lanemask_t = uint32_t;
#endif

PZ_DEVICE PZ_FORCE_INLINE int hw_lane() {
#if defined(PZ_HIP)
  return static_cast<int>(__lane_id());
#elif defined(PZ_WAVE_EMULATION)
  return static_cast<int>(threadIdx.x & 63);  // a wave is two warps
#else
  return static_cast<int>(threadIdx.x & 31);  // NVIDIA warps are always 32 wide
#endif
}

#if defined(PZ_WAVE_EMULATION)
// Wave64 emulation (platform.h): the wave of threads 64w..64w+63 is two
// warps, its halves (h: thread bit 5), standing for its two groups. AMD runs
// both groups in lockstep, lanes whose path skips a wave operation (ballot,
// group_sync) masked off while the others run it. Here each wave operation is
// a step: a half posts its step number (and a ballot's bits) and waits at the
// wave's 64-thread named barrier for the other half's step of that number. A
// half that reaches a CTA barrier or the kernel's end with no steps left
// stands in for its masked-off lanes (settle: steps posting nothing) until
// the other half gets there too. So the k-th wave operation of one half meets
// the k-th of the other or a stand-in, neither half runs a step ahead, and no
// named barrier waits for a half that never comes. Needs every CTA barrier
// through PZ_BLOCK_SYNC() and every kernel entry to open with PZ_WAVE_SCOPE.
namespace wave_emu {
constexpr int kMaxWaves = 8;  // CTAs of up to 512 threads: barrier ids 1..8 (0 is __syncthreads')
struct State {
  uint32_t step[2];     // [half]: the last step reached (posted before waiting at it)
  uint32_t settled[2];  // [half]: CTA barriers (and the end) reached
  uint32_t tag[2][2];   // [half][step & 1]: the step a ballot was posted at (0: none)
  uint32_t bits[2][2];  // [half][step & 1]: that ballot's 32 bits
};
PZ_DEVICE PZ_FORCE_INLINE volatile State& state() {
  __shared__ State s[kMaxWaves];
  return s[threadIdx.x >> 6];
}
PZ_DEVICE PZ_FORCE_INLINE int half() { return static_cast<int>(threadIdx.x >> 5) & 1; }
// The wave's 64 threads. Not .aligned: no convergence of a warp is assumed.
PZ_DEVICE PZ_FORCE_INLINE void wave_barrier() {
  asm volatile("barrier.sync %0, 64;" ::"r"(1 + static_cast<int>(threadIdx.x >> 6)) : "memory");
}
// One step of this half (all 32 lanes): posts bits (if a ballot), meets the
// other half's step of the same number and returns the bits it posted there,
// 0 if none (a group_sync or a stand-in: AMD's masked-off lanes ballot 0).
PZ_DEVICE inline uint32_t step(uint32_t bits, bool is_ballot) {
  volatile State& s = state();
  const int h = half();
  const uint32_t k = __shfl_sync(0xffffffffu, s.step[h], 0) + 1;  // only lane 0 writes it
  if ((threadIdx.x & 31) == 0) {
    s.bits[h][k & 1] = bits;
    s.tag[h][k & 1] = is_ballot ? k : 0u;
    __threadfence_block();  // posted before the step number the other half polls
    s.step[h] = k;
  }
  __syncwarp();
  wave_barrier();
  // Slot k & 1 is rewritten at step k + 2, which waits for this half's k + 1.
  return s.tag[h ^ 1][k & 1] == k ? s.bits[h ^ 1][k & 1] : 0u;
}
// At a CTA barrier or the end (all 32 lanes): stand in while the other half
// still has steps, until it gets here too. Its step number is never behind
// this half's here (this half's last step met it), so != means it waits.
PZ_DEVICE inline void settle() {
  volatile State& s = state();
  const int h = half();
  const uint32_t epoch = __shfl_sync(0xffffffffu, s.settled[h], 0) + 1;
  if ((threadIdx.x & 31) == 0) {
    __threadfence_block();
    s.settled[h] = epoch;
  }
  for (;;) {
    int act = 0;  // 0: poll again, 1: stand in for one step, 2: both here, steps matched
    if ((threadIdx.x & 31) == 0) {
      const uint32_t there = s.settled[h ^ 1];
      __threadfence_block();  // its step number read after its arrival
      act = s.step[h ^ 1] != s.step[h] ? 1 : there >= epoch ? 2 : 0;
    }
    act = __shfl_sync(0xffffffffu, act, 0);
    if (act == 2) break;
    if (act == 1) step(0, false);
  }
}
PZ_DEVICE PZ_FORCE_INLINE void begin() {
  volatile State& s = state();
  if ((threadIdx.x & 31) == 0) {
    const int h = half();
    s.step[h] = 0, s.settled[h] = 0, s.tag[h][0] = 0, s.tag[h][1] = 0;
  }
  __syncthreads();
}
}  // namespace wave_emu
#endif

// Lane index inside the 32-lane group.
PZ_DEVICE PZ_FORCE_INLINE int group_lane() { return hw_lane() & (kGroupLanes - 1); }

PZ_DEVICE PZ_FORCE_INLINE lanemask_t ballot(bool pred) {
#if defined(PZ_HIP)
  return __ballot(pred);
#elif defined(PZ_WAVE_EMULATION)
  const uint32_t mine = __ballot_sync(0xffffffffu, pred);
  const uint64_t other = wave_emu::step(mine, true);
  return wave_emu::half() ? (static_cast<uint64_t>(mine) << 32 | other) : (other << 32 | mine);
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
// exist before ROCm 7, so HIP gets fence + wave barrier + fence; the wave64
// emulation, a step (its 64-thread barrier).
PZ_DEVICE PZ_FORCE_INLINE void group_sync() {
#if defined(PZ_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#elif defined(PZ_WAVE_EMULATION)
  wave_emu::step(0, false);
#else
  __syncwarp();
#endif
}

// Barrier across the CTA: kernels write PZ_BLOCK_SYNC(), never __syncthreads
// (the wave64 emulation first settles each wave's steps). A macro: other
// builds compile exactly what they did before it (a wrapper function moved
// nvcc's register allocation).
#if defined(PZ_WAVE_EMULATION)
#define PZ_BLOCK_SYNC() (::pz::wave_emu::settle(), __syncthreads())
#else
#define PZ_BLOCK_SYNC() __syncthreads()
#endif

// Every kernel entry's first statement (gpu_kernels.cu). The wave64
// emulation holds a WaveScope for the whole body: its wave state set up
// first, and a half done early (a return may come from anywhere) standing in
// until its wave-mate is done too. Nothing otherwise, so the real builds'
// code is unchanged.
#if defined(PZ_WAVE_EMULATION)
struct WaveScope {
  PZ_DEVICE PZ_FORCE_INLINE WaveScope() { wave_emu::begin(); }
  PZ_DEVICE PZ_FORCE_INLINE ~WaveScope() { wave_emu::settle(); }
  WaveScope(const WaveScope&) = delete;
  WaveScope& operator=(const WaveScope&) = delete;
};
#define PZ_WAVE_SCOPE const ::pz::WaveScope pz_wave_scope
#else
#define PZ_WAVE_SCOPE static_cast<void>(0)
#endif

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
