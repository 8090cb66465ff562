// GPU launchers, compiled as CUDA or (LANGUAGE HIP in CMake, or hipcc -x hip)
// as HIP from this one source.
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

uint64_t gpu_compress_workspace_bytes(const fmt::Header& h) {
  const fmt::Layout l = fmt::layout_of(h);
  const uint64_t ctas = (l.nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  return 8 * ctas + 16;  // look-back status word per CTA + ticket counter
}

int gpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, void* workspace, void* stream, int max_sms) {
  if (h.codec == fmt::Codec::Raw || h.block_log2 > fmt::kEncoderMaxBlockLog2 ||
      reinterpret_cast<uintptr_t>(out) % fmt::kAlign || reinterpret_cast<uintptr_t>(workspace) % 8) {
    set_last_error("gpu_compress: needs a coded header, block_log2 <= 14, 16-byte aligned output, 8-byte aligned workspace", "");
    return kBadArgument;
  }
  const fmt::Layout l = fmt::layout_of(h);
  auto s = static_cast<rt::Stream>(stream);
  rt::Error e = rt::memset_async(workspace, 0, gpu_compress_workspace_bytes(h), s);
  if (e != rt::kSuccess) return fail(e, "clearing the compress workspace");
  gpu::CompressParams p{};
  p.in = in;
  p.out = out;
  p.status = static_cast<uint64_t*>(workspace);
  const uint64_t grid = (l.nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  p.ticket = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(workspace) + 8 * grid);
  p.h = h;
  fmt::write_header(h, p.header);
  const uint64_t smem = gpu::kGroupsPerCta * gpu::compress_smem_per_group(h.block_log2);
  // 16-byte vector loads need a 16-byte-aligned input (a view may start anywhere).
  const bool aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0;
  const int rc = PZ_DISPATCH_CODED_DTYPE(h.dtype, D, [&] {
    using fmt::Codec;
    auto kernel = h.codec == Codec::Fixed ? (aligned ? gpu::compress_kernel<D, true, Codec::Fixed>
                                                     : gpu::compress_kernel<D, false, Codec::Fixed>)
                                          : (aligned ? gpu::compress_kernel<D, true, Codec::Rans>
                                                     : gpu::compress_kernel<D, false, Codec::Rans>);
    rt::Error err = rt::set_max_dynamic_smem(kernel, static_cast<int>(smem));
    if (err != rt::kSuccess) return fail(err, "raising the compress kernel's shared-memory limit");
    unsigned ctas = 0;
    if (const int rc = persistent_grid(kernel, smem, grid, max_sms, &ctas)) return rc;
    kernel<<<ctas, gpu::kCtaThreads, smem, s>>>(p);
    err = rt::last_error();
    return err == rt::kSuccess ? static_cast<int>(kOk) : fail(err, "launching the compress kernel");
  });
  return rc;
}

int gpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, void* stream, int max_sms) {
  if (h.codec == fmt::Codec::Raw || reinterpret_cast<uintptr_t>(in) % fmt::kAlign) {
    set_last_error("gpu_decompress: needs a coded stream in a 16-byte-aligned buffer", "");
    return kBadArgument;
  }
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

}  // namespace pz
