// GPU launchers, compiled as CUDA or (LANGUAGE HIP in CMake, or hipcc -x hip)
// as HIP from this one source.
#include <vector>

#include "launch.h"
#include "portable_zip/gpu_codec.h"
#include "portable_zip/runtime.h"

namespace pz {

static int fail(rt::Error e, const char* what) {
  set_last_error(what, rt::error_string(e));
  return kRuntimeError;
}

// Persistent grid: as many CTAs as fit at once on max_sms SMs (all when <= 0),
// never more than there is work for.
template <class K>
static int persistent_grid(K kernel, uint64_t smem, uint64_t work, int max_sms, unsigned* grid) {
  int dev = 0, sms = 0, per_sm = 0;
  rt::Error e = rt::current_device(&dev);
  if (e == rt::kSuccess) e = rt::sm_count(dev, &sms);
  if (e == rt::kSuccess) e = rt::occupancy(&per_sm, kernel, gpu::kCtaThreads, smem);
  if (e != rt::kSuccess) return fail(e, "sizing the grid");
  if (max_sms > 0 && max_sms < sms) sms = max_sms;
  const uint64_t cap = static_cast<uint64_t>(sms) * static_cast<uint64_t>(per_sm > 0 ? per_sm : 1);
  *grid = static_cast<unsigned>(work < cap ? work : cap);
  return kOk;
}

static uint64_t tickets_of(const fmt::Header& h) {
  return (fmt::layout_of(h).nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
}

// Workspace: ticket counter (16 B), look-back status words of every tensor,
// then, for a batch, its parameter table and ticket ends. The first two are
// cleared on the stream; the table is copied in.
uint64_t gpu_compress_batch_workspace_bytes(const fmt::Header* hs, int n) {
  uint64_t tickets = 0;
  for (int j = 0; j < n; ++j) tickets += tickets_of(hs[j]);
  const uint64_t table = n > 1 ? fmt::align_up(8 * tickets, 16) + n * sizeof(gpu::CompressParams) + 8ull * n : 8 * tickets;
  return 16 + table;
}

uint64_t gpu_compress_workspace_bytes(const fmt::Header& h) { return gpu_compress_batch_workspace_bytes(&h, 1); }

int gpu_compress_batch(const uint8_t* const* ins, const fmt::Header* hs, uint8_t* const* outs, int n, void* workspace,
                       void* stream, int max_sms) {
  if (n < 1) return kOk;
  bool aligned = true;
  for (int j = 0; j < n; ++j) {
    const fmt::Header& h = hs[j];
    if (h.codec == fmt::Codec::Raw || h.block_log2 > fmt::kEncoderMaxBlockLog2 || h.dtype != hs[0].dtype ||
        h.codec != hs[0].codec || reinterpret_cast<uintptr_t>(outs[j]) % fmt::kAlign) {
      set_last_error("gpu_compress: needs coded headers of one dtype and codec, block_log2 <= 14, 16-byte aligned outputs", "");
      return kBadArgument;
    }
    // 16-byte vector loads need 16-byte-aligned inputs (a view may start anywhere).
    aligned = aligned && reinterpret_cast<uintptr_t>(ins[j]) % 16 == 0;
  }
  if (n > 1 && !aligned) {
    set_last_error("gpu_compress_batch: batched inputs must be 16-byte aligned", "");
    return kBadArgument;
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 16) {
    set_last_error("gpu_compress: the workspace must be 16-byte aligned", "");
    return kBadArgument;
  }
  auto s = static_cast<rt::Stream>(stream);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  std::vector<gpu::CompressParams> jobs(n);
  std::vector<uint64_t> ends(n);
  uint64_t tickets = 0;
  for (int j = 0; j < n; ++j) {
    gpu::CompressParams& p = jobs[j];
    p.in = ins[j];
    p.out = outs[j];
    p.status = reinterpret_cast<uint64_t*>(ws + 16) + tickets;
    p.h = hs[j];
    fmt::write_header(hs[j], p.header);
    ends[j] = tickets += tickets_of(hs[j]);
  }
  rt::Error e = rt::memset_async(ws, 0, 16 + 8 * tickets, s);
  if (e != rt::kSuccess) return fail(e, "clearing the compress workspace");
  gpu::CompressLaunch launch{};
  launch.one = jobs[0];
  launch.njobs = static_cast<uint32_t>(n);
  launch.ticket = reinterpret_cast<uint32_t*>(ws);
  if (n > 1) {  // pageable source: the copy is staged before the call returns
    uint8_t* table = ws + fmt::align_up(16 + 8 * tickets, 16);
    e = rt::memcpy_h2d_async(table, jobs.data(), n * sizeof(gpu::CompressParams), s);
    if (e == rt::kSuccess) e = rt::memcpy_h2d_async(table + n * sizeof(gpu::CompressParams), ends.data(), 8ull * n, s);
    if (e != rt::kSuccess) return fail(e, "copying the batch table");
    launch.jobs = reinterpret_cast<const gpu::CompressParams*>(table);
    launch.ticket_end = reinterpret_cast<const uint64_t*>(table + n * sizeof(gpu::CompressParams));
  }
  const uint64_t smem = gpu::kGroupsPerCta * gpu::compress_smem_per_group(hs[0].block_log2);
  return PZ_DISPATCH_CODED_DTYPE(hs[0].dtype, D, [&] {
    using fmt::Codec;
    // Single tensors read their parameters from the launch (no staging): a
    // separate instantiation, 13% faster at 256 MiB than the batched one.
    // Batches take aligned inputs only (callers send the rest one by one):
    // fewer instantiations to compile.
    using K = void (*)(gpu::CompressLaunch);
    const bool fixed = hs[0].codec == Codec::Fixed;
    const K kernel = n > 1 ? (fixed ? gpu::compress_kernel<D, true, Codec::Fixed, true>
                                    : gpu::compress_kernel<D, true, Codec::Rans, true>)
                           : (fixed ? (aligned ? gpu::compress_kernel<D, true, Codec::Fixed, false>
                                               : gpu::compress_kernel<D, false, Codec::Fixed, false>)
                                    : (aligned ? gpu::compress_kernel<D, true, Codec::Rans, false>
                                               : gpu::compress_kernel<D, false, Codec::Rans, false>));
    rt::Error err = rt::set_max_dynamic_smem(kernel, static_cast<int>(smem));
    if (err != rt::kSuccess) return fail(err, "raising the compress kernel's shared-memory limit");
    unsigned ctas = 0;
    if (const int rc = persistent_grid(kernel, smem, tickets, max_sms, &ctas)) return rc;
    kernel<<<ctas, gpu::kCtaThreads, smem, s>>>(launch);
    err = rt::last_error();
    return err == rt::kSuccess ? static_cast<int>(kOk) : fail(err, "launching the compress kernel");
  });
}

// Raw streams: one launch copies the payload and computes (encode) or checks
// (decode) its chunk checksums; encode also writes the header, whose total
// is known up front.
static int gpu_raw(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, bool encode, void* stream,
                   int max_sms) {
  gpu::RawParams p{};
  p.in = in;
  p.out = out;
  p.err = err;
  p.h = h;
  const fmt::Layout l = fmt::layout_of(h);
  if (encode) {
    p.h.total_bytes = l.coded_begin;
    fmt::write_header(p.h, p.header);
  }
  const uint64_t chunks = (l.raw_end - l.raw_begin + (1ull << fmt::kRawChunkLog2) - 1) >> fmt::kRawChunkLog2;
  if (!encode && chunks == 0) return kOk;
  const bool vec = reinterpret_cast<uintptr_t>(encode ? in : out) % 16 == 0;
  using K = void (*)(gpu::RawParams);
  const bool is_bool = h.dtype == fmt::DType::Bool;
  const K kernel = encode ? (vec ? gpu::raw_kernel<true, true, false> : gpu::raw_kernel<true, false, false>)
                          : is_bool ? (vec ? gpu::raw_kernel<false, true, true> : gpu::raw_kernel<false, false, true>)
                                    : (vec ? gpu::raw_kernel<false, true, false> : gpu::raw_kernel<false, false, false>);
  unsigned ctas = 0;
  const uint64_t work = (chunks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  if (const int rc = persistent_grid(kernel, 0, work > 0 ? work : 1, max_sms, &ctas)) return rc;
  kernel<<<ctas, gpu::kCtaThreads, 0, static_cast<rt::Stream>(stream)>>>(p);
  const rt::Error e = rt::last_error();
  return e == rt::kSuccess ? static_cast<int>(kOk) : fail(e, "launching the raw-stream kernel");
}

int gpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, void* workspace, void* stream, int max_sms) {
  if (h.codec == fmt::Codec::Raw) {
    if (reinterpret_cast<uintptr_t>(out) % fmt::kAlign) {
      set_last_error("gpu_compress: the output must be 16-byte aligned", "");
      return kBadArgument;
    }
    return gpu_raw(in, h, out, nullptr, true, stream, max_sms);
  }
  return gpu_compress_batch(&in, &h, &out, 1, workspace, stream, max_sms);
}

int gpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, void* stream, int max_sms) {
  if (reinterpret_cast<uintptr_t>(in) % fmt::kAlign) {
    set_last_error("gpu_decompress: needs a stream in a 16-byte-aligned buffer", "");
    return kBadArgument;
  }
  if (h.codec == fmt::Codec::Raw) return gpu_raw(in, h, out, err, false, stream, max_sms);
  const fmt::Layout l = fmt::layout_of(h);
  auto s = static_cast<rt::Stream>(stream);
  gpu::DecompressParams p{in, out, err, h};
  // The fixed code needs no shared tables, so its kernel runs at full occupancy.
  const bool fixed = h.codec == fmt::Codec::Fixed;
  const uint64_t smem = fixed ? 0 : gpu::kGroupsPerCta * gpu::kDecompressSmemPerGroup;
  const uint64_t grid = (l.nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  return PZ_DISPATCH_CODED_DTYPE(h.dtype, D, [&] {
    auto kernel = fixed ? gpu::decompress_kernel<D, fmt::Codec::Fixed> : gpu::decompress_kernel<D, fmt::Codec::Rans>;
    unsigned ctas = 0;
    if (const int rc = persistent_grid(kernel, smem, grid, max_sms, &ctas)) return rc;
    kernel<<<ctas, gpu::kCtaThreads, smem, s>>>(p);
    const rt::Error e = rt::last_error();
    return e == rt::kSuccess ? static_cast<int>(kOk) : fail(e, "launching the decompress kernel");
  });
}

int gpu_device_info(int device, int* warp_size, int* sm_count) {
  rt::Error e = rt::warp_size(device, warp_size);
  if (e == rt::kSuccess) e = rt::sm_count(device, sm_count);
  return e == rt::kSuccess ? static_cast<int>(kOk) : fail(e, "querying the device");
}

// --- staging copies for the fabric engine ---------------------------------
static int ok_or(rt::Error e, const char* what) { return e == rt::kSuccess ? static_cast<int>(kOk) : fail(e, what); }

int gpu_set_device(int device) { return ok_or(rt::set_device(device), "selecting the device"); }

int gpu_stream_new(void** stream) {
  rt::Stream s = nullptr;
  const int rc = ok_or(rt::stream_create(&s), "creating the staging stream");
  *stream = static_cast<void*>(s);
  return rc;
}

int gpu_stream_free(void* stream) { return ok_or(rt::stream_destroy(static_cast<rt::Stream>(stream)), "freeing a stream"); }

int gpu_event_new(void** ev) {
  rt::Event e = nullptr;
  const int rc = ok_or(rt::event_create(&e), "creating an event");
  *ev = static_cast<void*>(e);
  return rc;
}

int gpu_event_free(void* ev) { return ok_or(rt::event_destroy(static_cast<rt::Event>(ev)), "freeing an event"); }

int gpu_copy_async(void* dst, const void* src, uint64_t n, void* stream, void* ev) {
  const auto s = static_cast<rt::Stream>(stream);
  rt::Error e = rt::memcpy_async(dst, src, n, s);
  if (e == rt::kSuccess) e = rt::event_record(static_cast<rt::Event>(ev), s);
  return ok_or(e, "queueing a staging copy");
}

int gpu_event_done(void* ev) {
  const rt::Error e = rt::event_query(static_cast<rt::Event>(ev));
  if (e == rt::kNotReady) return 0;
  return e == rt::kSuccess ? 1 : fail(e, "a staging copy failed");
}

int gpu_stream_after(void* stream, void* user_stream, void* ev) {
  const auto e_ = static_cast<rt::Event>(ev);
  rt::Error e = rt::event_record(e_, static_cast<rt::Stream>(user_stream));
  if (e == rt::kSuccess) e = rt::stream_wait(static_cast<rt::Stream>(stream), e_);
  return ok_or(e, "ordering the staging stream after the caller's");
}

int gpu_pinned_alloc(void** p, uint64_t n) { return ok_or(rt::host_alloc(p, n), "allocating pinned staging memory"); }

int gpu_pinned_free(void* p) { return ok_or(rt::host_free(p), "freeing pinned staging memory"); }

}  // namespace pz
