// The entry points of the device module, by name. kernels/gpu_kernels.cu
// defines each as extern "C" (so no name mangling differs between compilers);
// the host launcher resolves them when it loads the module, so a name missing
// on either side fails there, loudly.
#pragma once
#include <string>

#include "portable_zip/format.h"
#include "portable_zip/gpu_params.h"

namespace pz::gpu {

inline const char* dtype_token(fmt::DType d) {
  switch (d) {
    case fmt::DType::BFloat16: return "BFloat16";
    case fmt::DType::Float16: return "Float16";
    case fmt::DType::Float32: return "Float32";
    case fmt::DType::Float8E4M3FN: return "Float8E4M3FN";
    case fmt::DType::Float8E5M2: return "Float8E5M2";
    default: return nullptr;  // not entropy-coded: no kernel
  }
}

// Fixed, Rans (32 lanes), RansWide (64 lanes: two states a GPU lane).
inline const char* codec_token(fmt::Codec c, int lanes) {
  return c == fmt::Codec::Fixed ? "Fixed" : lanes == fmt::kWideLanes ? "RansWide" : "Rans";
}

// pz_compress_<dtype>_<aligned>_<codec>_<batched>, e.g. pz_compress_BFloat16_true_Rans_false.
// Batches and unaligned inputs have one rANS kernel for both lane counts
// (each tensor's header says: gpu_params.h, compress_states).
inline std::string compress_name(fmt::DType d, bool aligned, fmt::Codec c, bool batched, int lanes) {
  return std::string("pz_compress_") + dtype_token(d) + (aligned ? "_true_" : "_false_") +
         codec_token(c, gpu::compress_states(lanes, aligned, batched) == 2 ? fmt::kWideLanes : fmt::kLanes) +
         (batched ? "_true" : "_false");
}

// pz_decompress_<dtype>_<codec>: a stream's decode, host-parsed or the fast
// path of a device-parsed one (gpu_params.h, DecompressLaunch).
inline std::string decompress_name(fmt::DType d, fmt::Codec c, int lanes) {
  return std::string("pz_decompress_") + dtype_token(d) + "_" + codec_token(c, lanes);
}

// pz_decode_<dtype>: the device-parsed decode of one coded dtype; pz_decode_Raw: of every other dtype.
inline std::string device_decode_name(fmt::DType d) {
  return std::string("pz_decode_") + (dtype_token(d) ? dtype_token(d) : "Raw");
}

inline std::string raw_name(bool encode, bool vec, bool is_bool) {
  return std::string("pz_raw_") + (encode ? "true_" : "false_") + (vec ? "true_" : "false_") + (is_bool ? "true" : "false");
}

// Weight deltas: pz_delta_<plan|write|decode>_<element bits>, pz_delta_table, pz_delta_checksum.
inline std::string delta_name(const char* what, int bits) {
  return std::string("pz_delta_") + what + (bits ? "_" + std::to_string(bits) : std::string());
}

}  // namespace pz::gpu
