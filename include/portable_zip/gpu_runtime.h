// The GPU runtime calls a transport needs to stage device memory through
// host memory: streams, events, copies and pinned allocations on whichever
// vendor runtime kernels/device_api.h loaded. Handles are opaque; every call
// returns a LaunchStatus (status.h). Host code only; implemented in
// kernels/gpu_launch.cpp, so a transport includes this and nothing of kernels/.
#pragma once
#include <stdint.h>

#include "status.h"

namespace pz {

int gpu_set_device(int device);
int gpu_stream_new(void** stream);
int gpu_stream_free(void* stream);
int gpu_event_new(void** ev);
int gpu_event_free(void* ev);
// Queues a copy (any direction) on stream and records ev after it.
int gpu_copy_async(void* dst, const void* src, uint64_t n, void* stream, void* ev);
int gpu_event_done(void* ev);  // 1 done, 0 pending, kRuntimeError on failure
int gpu_stream_after(void* stream, void* user_stream, void* ev);  // stream waits for user_stream's queued work
int gpu_pinned_alloc(void** p, uint64_t n);  // pinned, portable across devices
int gpu_pinned_free(void* p);

}  // namespace pz
