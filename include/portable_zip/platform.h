// The only file in portable_zip that tests vendor macros.
// Everything else asks PZ_CUDA / PZ_HIP / PZ_HOST and PZ_DEVICE_COMPILE.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define PZ_HIP 1
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#define PZ_CUDA 1
#if !defined(__CUDACC_RTC__)  // NVRTC declares the device built-ins itself
#include <cuda_runtime.h>
#endif
#else
#define PZ_HOST 1
#endif

// True while compiling device code (either vendor's device pass).
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define PZ_DEVICE_COMPILE 1
#endif

#if defined(PZ_CUDA) || defined(PZ_HIP)
#define PZ_HOST_DEVICE __host__ __device__
#define PZ_DEVICE __device__
#define PZ_GLOBAL __global__
#define PZ_FORCE_INLINE __forceinline__
#else
#define PZ_HOST_DEVICE
#define PZ_DEVICE
#define PZ_GLOBAL
#define PZ_FORCE_INLINE inline __attribute__((always_inline))
#endif

// Hardware wavefront width of the device pass. gfx9 (CDNA) is wave64; RDNA and
// NVIDIA are wave32. Deliberately undefined in host passes: use
// pz::host_warp_size() there.
// PZ_EMULATE_WAVE64 (the wave64 test build, NVIDIA only: cmake
// -DPZ_EMULATE_WAVE64=ON) makes the device pass wave64: a wave is two warps
// kept in step (intrinsics.h, PZ_WAVE_EMULATION), so gfx9's paths run on NVIDIA.
#if defined(PZ_EMULATE_WAVE64) && defined(PZ_HIP)
#error "PZ_EMULATE_WAVE64 emulates wave64 on NVIDIA GPUs; build HIP for a gfx9 target instead"
#endif
#if defined(PZ_DEVICE_COMPILE)
#if defined(PZ_HIP) && defined(__AMDGCN_WAVEFRONT_SIZE)
#define PZ_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#elif defined(PZ_HIP) && defined(__GFX9__)
#define PZ_WARP_SIZE 64
#elif defined(PZ_CUDA) && defined(PZ_EMULATE_WAVE64)
#define PZ_WARP_SIZE 64
#define PZ_WAVE_EMULATION 1
#else
#define PZ_WARP_SIZE 32
#endif
#endif

#define PZ_MAX_WARP_SIZE 64

// Host code only: a hot CPU loop built twice, baseline and AVX2 (8 32-bit
// multiplies per instruction instead of SSE2's emulated 4), the one to run
// picked when the library loads (GCC target_clones, an ifunc on Linux).
// GCC only: clang (the libFuzzer build) cannot multiversion function templates.
#if defined(PZ_HOST) && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define PZ_HOST_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PZ_HOST_SIMD_CLONES
#endif

// Host code only: hand-written AVX2 paths of the CPU codec (cpu_simd.h),
// compiled with a target attribute and chosen at run time (scalar otherwise).
#if defined(PZ_HOST) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PZ_HOST_AVX2 1
#define PZ_TARGET_AVX2 __attribute__((target("avx2,bmi2,popcnt")))
#endif
