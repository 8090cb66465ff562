// The device module: every kernel's entry point, compiled as CUDA or HIP
// device code only (no host pass) into the files the package loads at run
// time (cubins/PTX, or an AMD code-object bundle). Names follow
// kernel_names.h; the launcher resolves all of them at load. Every entry's
// body starts with PZ_WAVE_SCOPE (intrinsics.h: the wave64 emulation's
// bookkeeping; nothing in other builds).
#include "portable_zip/delta_gpu.h"
#include "portable_zip/gpu_codec.h"

namespace pz::gpu {

// CTAs per SM some kernels are built for (__launch_bounds__' second
// argument; 0: none, which is not the same as 1: ptxas then budgets
// registers otherwise). The 64-lane kernels (two states a lane) and the
// device-parsed decode of any stream (both lane counts in one kernel) need
// more registers than the rest; a bound keeps their occupancy.
#ifndef PZ_WIDE_COMPRESS_CTAS
#define PZ_WIDE_COMPRESS_CTAS 0
#endif
#define PZ_BOUNDS(M) PZ_BOUNDS_##M
#define PZ_BOUNDS_0 __launch_bounds__(kCtaThreads)
#define PZ_BOUNDS_8 __launch_bounds__(kCtaThreads, 8)
#define PZ_BOUNDS_9 __launch_bounds__(kCtaThreads, 9)
#define PZ_BOUNDS_10 __launch_bounds__(kCtaThreads, 10)
#define PZ_BOUNDS_12 __launch_bounds__(kCtaThreads, 12)
#define PZ_BOUNDS_16 __launch_bounds__(kCtaThreads, 16)
#define PZ_BOUNDS_OF(M) PZ_BOUNDS(M)  // expands M first
// T: the codec token of the name (kernel_names.h), S: rANS states a lane
// (gpu_params.h, compress_states; 0: from each tensor's header), M: CTAs per
// SM (PZ_BOUNDS).
#define PZ_COMPRESS(D, A, C, T, B, S, M)                                                                       \
  extern "C" PZ_GLOBAL void PZ_BOUNDS_OF(M) pz_compress_##D##_##A##_##T##_##B(CompressLaunch l) {            \
    PZ_WAVE_SCOPE;                                                                                             \
    compress_kernel<fmt::DType::D, A, fmt::Codec::C, B, S>(l);                                                  \
  }
#define PZ_DECOMPRESS(D, C, T, S, M)                                                                        \
  extern "C" PZ_GLOBAL void PZ_BOUNDS_OF(M) pz_decompress_##D##_##T(DecompressLaunch d) {                    \
    PZ_WAVE_SCOPE;                                                                                          \
    decompress_kernel<fmt::DType::D, fmt::Codec::C, S>(d);                                                  \
  }
// Aligned single tensors: a kernel per codec and lane count; unaligned
// ones and batches: one per codec (rANS: either lane count). The rANS
// decompress kernels also run the fast path of a device-parsed decode. WD,
// GD: CTAs per SM of the 64-lane decoder and of the device-parsed decode of
// any stream.
#define PZ_CODED(D, WD, GD)                                                                                 \
  PZ_COMPRESS(D, true, Fixed, Fixed, false, 1, 0)                                                           \
  PZ_COMPRESS(D, false, Fixed, Fixed, false, 1, 0)                                                          \
  PZ_COMPRESS(D, true, Rans, Rans, false, 1, 0)                                                             \
  PZ_COMPRESS(D, true, Rans, RansWide, false, 2, PZ_WIDE_COMPRESS_CTAS)                                     \
  PZ_COMPRESS(D, false, Rans, Rans, false, 0, 0)                                                            \
  PZ_COMPRESS(D, true, Fixed, Fixed, true, 1, 0)                                                            \
  PZ_COMPRESS(D, true, Rans, Rans, true, 0, 0)                                                              \
  PZ_DECOMPRESS(D, Fixed, Fixed, 1, 0)                                                                      \
  PZ_DECOMPRESS(D, Rans, Rans, 1, 0)                                                                        \
  PZ_DECOMPRESS(D, Rans, RansWide, 2, WD)                                                                   \
  extern "C" PZ_GLOBAL void PZ_BOUNDS_OF(GD) pz_decode_##D(DeviceDecodeLaunch l) {                         \
    PZ_WAVE_SCOPE;                                                                                          \
    device_decode_kernel<fmt::DType::D>(l);                                                                 \
  }

// 16 CTAs: 64 registers (measured: bf16 1 GiB decode 995 -> 1126 GB/s
// against the compiler's 128); 10: the 96 of the 32-lane-only kernel before
// format v4. fp32 (128 registers before v4; never 64 lanes from this
// encoder, see fmt::plan_header) keeps 8 for both.
PZ_CODED(BFloat16, 16, 10)
PZ_CODED(Float16, 16, 10)
PZ_CODED(Float32, 8, 8)
PZ_CODED(Float8E4M3FN, 16, 10)
PZ_CODED(Float8E5M2, 16, 10)

#define PZ_RAW(E, V, B)                                                                          \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_raw_##E##_##V##_##B(RawParams p) { \
    PZ_WAVE_SCOPE;                                                                               \
    raw_kernel<E, V, B>(p);                                                                      \
  }
PZ_RAW(true, true, false)
PZ_RAW(true, false, false)
PZ_RAW(false, true, false)
PZ_RAW(false, false, false)
PZ_RAW(false, true, true)
PZ_RAW(false, false, true)
// Device-parsed decodes of every dtype that is never coded (and bool).
extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decode_Raw(DeviceDecodeLaunch l) {
  PZ_WAVE_SCOPE;
  device_decode_kernel<fmt::DType::Invalid>(l);
}

// Weight deltas (delta_gpu.h): per element width, plan, write and decode.
#define PZ_DELTA(W)                                                                                          \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_delta_plan_##W(DeltaParams p) {               \
    PZ_WAVE_SCOPE;                                                                                          \
    delta_plan_kernel<uint##W##_t>(p);                                                                      \
  }                                                                                                         \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_delta_write_##W(DeltaParams p) {              \
    PZ_WAVE_SCOPE;                                                                                          \
    delta_write_kernel<uint##W##_t>(p);                                                                     \
  }                                                                                                         \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_delta_decode_##W(DeltaParams p) {             \
    PZ_WAVE_SCOPE;                                                                                          \
    delta_decode_kernel<uint##W##_t>(p);                                                                    \
  }
PZ_DELTA(8)
PZ_DELTA(16)
PZ_DELTA(32)
extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_delta_table(DeltaTableParams p) {
  PZ_WAVE_SCOPE;
  delta_table_kernel(p);
}
extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_delta_checksum(DeltaSumParams p) {
  PZ_WAVE_SCOPE;
  delta_checksum_kernel(p);
}

}  // namespace pz::gpu
