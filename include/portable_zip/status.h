// Return codes of the compiled library's plain C++ entry points (the codec
// launchers, kernels/launch.h, and the runtime calls of gpu_runtime.h).
// Host code only; implemented in kernels/cpu_launch.cpp.
#pragma once

namespace pz {

// 0 = ok. Runtime errors carry their message through last_error_message(),
// kept per thread: read it on the thread whose call failed.
enum LaunchStatus : int { kOk = 0, kBadArgument = 1, kRuntimeError = 2 };
const char* last_error_message();
void set_last_error(const char* what, const char* detail);

}  // namespace pz
