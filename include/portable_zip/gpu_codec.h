// GPU kernels, for CUDA and HIP from one source. Compress, decompress and
// raw streams each have their own header; gpu_group.h holds what they share
// and gpu_params.h what the host launcher shares with them.
#pragma once

#include "gpu_compress.h"
#include "gpu_decompress.h"
#include "gpu_raw.h"
