// The device module: every kernel's entry point, compiled as CUDA or HIP
// device code only (no host pass) into the files the package loads at run
// time (cubins/PTX, or an AMD code-object bundle). Names follow
// kernel_names.h; the launcher resolves all of them at load.
#include "portable_zip/gpu_codec.h"

namespace pz::gpu {

#define PZ_COMPRESS(D, A, C, B)                                                                             \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_compress_##D##_##A##_##C##_##B(CompressLaunch l) { \
    compress_kernel<fmt::DType::D, A, fmt::Codec::C, B>(l);                                                  \
  }
// Single tensors, aligned or not; batches take aligned inputs only.
#define PZ_CODED(D)                                                                                         \
  PZ_COMPRESS(D, true, Fixed, false)                                                                        \
  PZ_COMPRESS(D, false, Fixed, false)                                                                       \
  PZ_COMPRESS(D, true, Rans, false)                                                                         \
  PZ_COMPRESS(D, false, Rans, false)                                                                        \
  PZ_COMPRESS(D, true, Fixed, true)                                                                         \
  PZ_COMPRESS(D, true, Rans, true)                                                                          \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decompress_##D##_Fixed(DecompressParams p) {  \
    decompress_kernel<fmt::DType::D, fmt::Codec::Fixed>(p);                                                 \
  }                                                                                                         \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decompress_##D##_Rans(DecompressParams p) {   \
    decompress_kernel<fmt::DType::D, fmt::Codec::Rans>(p);                                                  \
  }                                                                                                         \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decode_##D(DeviceDecodeLaunch l) {            \
    device_decode_kernel<fmt::DType::D>(l);                                                                 \
  }                                                                                                         \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decode_fast_##D(FastDecode f) {               \
    fast_decode_kernel<fmt::DType::D>(f);                                                                   \
  }

PZ_CODED(BFloat16)
PZ_CODED(Float16)
PZ_CODED(Float32)
PZ_CODED(Float8E4M3FN)
PZ_CODED(Float8E5M2)

#define PZ_RAW(E, V, B) \
  extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_raw_##E##_##V##_##B(RawParams p) { raw_kernel<E, V, B>(p); }
PZ_RAW(true, true, false)
PZ_RAW(true, false, false)
PZ_RAW(false, true, false)
PZ_RAW(false, false, false)
PZ_RAW(false, true, true)
PZ_RAW(false, false, true)
// Device-parsed decodes of every dtype that is never coded (and bool).
extern "C" PZ_GLOBAL void __launch_bounds__(kCtaThreads) pz_decode_Raw(DeviceDecodeLaunch l) {
  device_decode_kernel<fmt::DType::Invalid>(l);
}

}  // namespace pz::gpu
