// GPU launchers: plain host C++. The kernels live in the device module
// (gpu_kernels.cu, loaded at run time through device_api.h) and are found by
// name (kernel_names.h), so this file serves CUDA and HIP alike.
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "device_api.h"
#include "kernel_names.h"
#include "launch.h"
#include "portable_zip/delta_gpu.h"
#include "portable_zip/gpu_params.h"

namespace pz {

static int fail(int e, const char* what) {
  set_last_error(what, dev::error_text(e).c_str());
  return kRuntimeError;
}

// A kernel ready to launch on the calling thread's device (device < 0: the
// current one): resolved, its shared-memory limit raised, and its CTAs per
// SM and the SM count known. Cached per (device, kernel, smem): the launch
// path makes no queries after the first.
struct Ready {
  dev::Function f = nullptr;
  int sms = 0;
  int per_sm = 0;
  uint64_t ctas_per_sm() const { return static_cast<uint64_t>(per_sm > 0 ? per_sm : 1); }
};

static int ready(int device, const std::string& name, uint64_t smem, Ready* r) {
  int e = device >= 0 ? 0 : dev::current_device(&device);
  if (e) return fail(e, "finding the current device");
  static std::mutex mu;
  static std::map<std::tuple<int, std::string, uint64_t>, Ready> cache;
  const auto key = std::make_tuple(device, name, smem);
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      *r = it->second;
      const int ue = dev::use_device(device);
      return ue ? fail(ue, "selecting the device") : static_cast<int>(kOk);
    }
  }
  e = dev::kernel(device, name, &r->f);  // also makes the device current
  if (e) return fail(e, "loading the GPU kernels");
  if (smem > 48 * 1024 && (e = dev::set_max_dynamic_smem(r->f, static_cast<int>(smem))))
    return fail(e, "raising a kernel's shared-memory limit");
  if ((e = dev::attribute(device, dev::Attr::SmCount, &r->sms)) ||
      (e = dev::occupancy(r->f, gpu::kCtaThreads, smem, &r->per_sm)))
    return fail(e, "sizing the grid");
  std::lock_guard<std::mutex> lk(mu);
  cache[key] = *r;
  return kOk;
}

// A launch's grid: ctas CTAs, sized for sms SMs.
struct Grid {
  uint64_t ctas;
  int sms;
};

// Persistent grid: as many CTAs as fit at once on max_sms SMs (all when <= 0),
// never more than there is work for.
static Grid persistent_grid(const Ready& r, uint64_t work, int max_sms) {
  const int sms = max_sms > 0 && max_sms < r.sms ? max_sms : r.sms;
  const uint64_t cap = static_cast<uint64_t>(sms) * r.ctas_per_sm();
  return {work < cap ? work : cap, sms};
}

// The launch report (launch.h): every launch run() makes counts, so no
// launch path can escape it. Relaxed atomics: counters, nothing ordered by them.
static std::atomic<uint64_t> g_launches{0}, g_max_grid{0}, g_max_sms{0}, g_max_grid_sms{0};

static void raise_to(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

static void report_launch(const Ready& r, const Grid& g) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  raise_to(g_max_grid, g.ctas);
  raise_to(g_max_sms, static_cast<uint64_t>(g.sms));
  raise_to(g_max_grid_sms, (g.ctas + r.ctas_per_sm() - 1) / r.ctas_per_sm());
}

LaunchReport gpu_launch_report(bool reset) {
  auto take = [reset](std::atomic<uint64_t>& a) {
    return reset ? a.exchange(0, std::memory_order_relaxed) : a.load(std::memory_order_relaxed);
  };
  LaunchReport rep;
  rep.launches = take(g_launches);
  rep.max_grid = take(g_max_grid);
  rep.max_sms = take(g_max_sms);
  rep.max_grid_sms = take(g_max_grid_sms);
  return rep;
}

template <class P>
static int run(const Ready& r, const Grid& g, uint64_t smem, void* stream, P& params, const char* what) {
  const int e = dev::launch(r.f, static_cast<unsigned>(g.ctas), gpu::kCtaThreads, smem, stream, &params);
  if (e) return fail(e, what);
  report_launch(r, g);
  return kOk;
}

static uint64_t tickets_of(const fmt::Header& h) {
  return (fmt::layout_of(h).nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
}

// A batch's job table and ticket ends in one host buffer, laid out exactly as
// the kernels read them on the device (the ends at byte ends_at), so one
// pageable copy stages both: a driver call per launch instead of two. The
// driver stages a pageable source before the copy call returns, so the buffer
// may go when the launcher does.
template <class Job>
struct HostTable {
  static_assert(std::is_trivially_copyable<Job>::value && alignof(Job) <= alignof(uint64_t) &&
                    sizeof(Job) % sizeof(uint64_t) == 0, "copied as bytes, the ends 8-byte aligned after them");
  std::vector<uint64_t> words;  // zeroed: padding bytes are copied too
  Job* jobs;
  uint64_t* ends;
  uint64_t bytes;
  HostTable(int n, uint64_t ends_at) : words((ends_at + 8ull * n + 7) / 8), bytes(ends_at + 8ull * n) {
    jobs = reinterpret_cast<Job*>(words.data());
    std::uninitialized_value_construct_n(jobs, n);
    ends = words.data() + ends_at / 8;
  }
  int copy_to(void* table, void* stream) const { return dev::memcpy_async(table, words.data(), bytes, stream); }
};

// Spill slots for a launch of `tickets` CTA tickets: one CTA per ticket at
// most, never more than kSpillCtas, nor more than are resident at once on
// the device (the aligned kernel's persistent grid on every SM; the launch
// caps its grid to this). *ctas = 0 for the fixed code, which never spills.
// aligned: the aligned kernel, ready (a launcher that has it asks no cache).
static uint64_t spill_slots(const fmt::Header& h0, const Ready& aligned, uint64_t tickets) {
  if (h0.codec != fmt::Codec::Rans) return 0;
  uint64_t cap = static_cast<uint64_t>(aligned.sms) * aligned.ctas_per_sm();
  if (cap > gpu::kSpillCtas) cap = gpu::kSpillCtas;
  return tickets < cap ? tickets : cap;
}

static int spill_ctas(const fmt::Header& h0, int n, uint64_t tickets, int device, uint64_t* ctas) {
  *ctas = 0;
  if (h0.codec != fmt::Codec::Rans) return kOk;
  Ready r;
  const uint64_t smem = gpu::kGroupsPerCta * gpu::compress_smem_per_group(gpu::compress_states(h0.lanes, true, n > 1));
  if (const int rc = ready(device, gpu::compress_name(h0.dtype, true, h0.codec, n > 1, h0.lanes), smem, &r)) return rc;
  *ctas = spill_slots(h0, r, tickets);
  return kOk;
}

// Workspace: ticket counter (16 B), look-back status words of every tensor,
// then, for a batch, its parameter table and ticket ends, then (rANS) the
// spill slots of the grid's CTAs (gpu_params.h: kSpillBytes). The first two
// are cleared on the stream; the table is copied in.
struct CompressWorkspace {
  uint64_t table;  // a batch's parameter table, then its ticket ends
  uint64_t spill;
  uint64_t bytes;
};

static CompressWorkspace compress_workspace(uint64_t tickets, int n, uint64_t spill_slots) {
  CompressWorkspace w;
  w.table = fmt::align_up(16 + 8 * tickets, 16);
  const uint64_t end = n > 1 ? w.table + n * sizeof(gpu::CompressParams) + 8ull * n : 16 + 8 * tickets;
  w.spill = fmt::align_up(end, 16);
  w.bytes = w.spill + spill_slots * gpu::kGroupsPerCta * gpu::kSpillBytes;
  return w;
}

static uint64_t tickets_of(const fmt::Header* hs, int n) {
  uint64_t tickets = 0;
  for (int j = 0; j < n; ++j) tickets += tickets_of(hs[j]);
  return tickets;
}

int gpu_compress_batch_workspace_bytes(const fmt::Header* hs, int n, int device, uint64_t* bytes) {
  *bytes = 16;
  if (n < 1) return kOk;
  if (hs[0].codec == fmt::Codec::Raw) return kOk;  // a raw stream's kernel needs none
  const uint64_t tickets = tickets_of(hs, n);
  uint64_t slots;
  if (const int rc = spill_ctas(hs[0], n, tickets, device, &slots)) return rc;
  *bytes = compress_workspace(tickets, n, slots).bytes;
  return kOk;
}

int gpu_compress_workspace_bytes(const fmt::Header& h, int device, uint64_t* bytes) {
  return gpu_compress_batch_workspace_bytes(&h, 1, device, bytes);
}

int gpu_compress_batch(const uint8_t* const* ins, const fmt::Header* hs, uint8_t* const* outs, int n, void* workspace,
                       void* stream, int device, int max_sms) {
  if (n < 1) return kOk;
  bool aligned = true;
  for (int j = 0; j < n; ++j) {
    const fmt::Header& h = hs[j];
    const bool lanes_ok = h.lanes == fmt::kLanes || (h.lanes == fmt::kWideLanes && h.codec == fmt::Codec::Rans);
    if (h.codec == fmt::Codec::Raw || h.block_log2 > fmt::kEncoderMaxBlockLog2 || h.dtype != hs[0].dtype ||
        h.codec != hs[0].codec || !lanes_ok || !gpu::dtype_token(h.dtype) ||
        reinterpret_cast<uintptr_t>(outs[j]) % fmt::kAlign) {
      set_last_error("gpu_compress: needs coded headers of one dtype and codec, block_log2 <= 15, 32 lanes (64 with "
                     "rANS), 16-byte aligned outputs", "");
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
  // Single tensors read their parameters from the launch (no staging): a
  // separate kernel, 13% faster at 256 MiB than the batched one. Batches take
  // aligned inputs only (callers send the rest one by one).
  const uint64_t smem =
      gpu::kGroupsPerCta * gpu::compress_smem_per_group(gpu::compress_states(hs[0].lanes, aligned, n > 1));
  Ready r;
  if (const int rc = ready(device, gpu::compress_name(hs[0].dtype, aligned, hs[0].codec, n > 1, hs[0].lanes), smem, &r))
    return rc;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  HostTable<gpu::CompressParams> t(n, n * sizeof(gpu::CompressParams));  // the ends right after the jobs
  uint64_t tickets = 0;
  for (int j = 0; j < n; ++j) {
    gpu::CompressParams& p = t.jobs[j];
    p.in = ins[j];
    p.out = outs[j];
    p.status = reinterpret_cast<uint64_t*>(ws + 16) + tickets;
    p.h = hs[j];
    fmt::write_header(hs[j], p.header);
    t.ends[j] = tickets += tickets_of(hs[j]);
  }
  int e = dev::memset_async(ws, 0, 16 + 8 * tickets, stream);
  if (e) return fail(e, "clearing the compress workspace");
  gpu::CompressLaunch launch{};
  launch.one = t.jobs[0];
  launch.njobs = static_cast<uint32_t>(n);
  launch.ticket = reinterpret_cast<uint32_t*>(ws);
  // The spill slots follow the aligned kernel: r when this launch runs it.
  uint64_t slots = aligned ? spill_slots(hs[0], r, tickets) : 0;
  if (!aligned)
    if (const int rc = spill_ctas(hs[0], n, tickets, device, &slots)) return rc;
  const CompressWorkspace w = compress_workspace(tickets, n, slots);
  launch.spill = slots ? ws + w.spill : nullptr;
  if (n > 1) {
    uint8_t* table = ws + w.table;
    if ((e = t.copy_to(table, stream))) return fail(e, "copying the batch table");
    launch.jobs = reinterpret_cast<const gpu::CompressParams*>(table);
    launch.ticket_end = reinterpret_cast<const uint64_t*>(table + n * sizeof(gpu::CompressParams));
  }
  // A spilling grid has a slot per CTA: at most `slots` CTAs.
  Grid grid = persistent_grid(r, tickets, max_sms);
  if (slots && grid.ctas > slots) grid.ctas = slots;
  return run(r, grid, smem, stream, launch, "launching the compress kernel");
}

// Raw streams: one launch copies the payload and computes (encode) or checks
// (decode) its chunk checksums; encode also writes the header, whose total
// is known up front.
static int gpu_raw(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, bool encode, void* stream,
                   int device, int max_sms) {
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
  const bool is_bool = !encode && h.dtype == fmt::DType::Bool;
  Ready r;
  if (const int rc = ready(device, gpu::raw_name(encode, vec, is_bool), 0, &r)) return rc;
  const uint64_t work = (chunks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  return run(r, persistent_grid(r, work > 0 ? work : 1, max_sms), 0, stream, p, "launching the raw-stream kernel");
}

int gpu_compress(const uint8_t* in, const fmt::Header& h, uint8_t* out, void* workspace, void* stream, int device,
                 int max_sms) {
  if (h.codec == fmt::Codec::Raw) {
    if (reinterpret_cast<uintptr_t>(out) % fmt::kAlign) {
      set_last_error("gpu_compress: the output must be 16-byte aligned", "");
      return kBadArgument;
    }
    return gpu_raw(in, h, out, nullptr, true, stream, device, max_sms);
  }
  return gpu_compress_batch(&in, &h, &out, 1, workspace, stream, device, max_sms);
}

int gpu_decompress(const uint8_t* in, const fmt::Header& h, uint8_t* out, uint32_t* err, void* stream, int device,
                   int max_sms) {
  if (reinterpret_cast<uintptr_t>(in) % fmt::kAlign) {
    set_last_error("gpu_decompress: needs a stream in a 16-byte-aligned buffer", "");
    return kBadArgument;
  }
  if (h.codec == fmt::Codec::Raw) return gpu_raw(in, h, out, err, false, stream, device, max_sms);
  if (!gpu::dtype_token(h.dtype)) {
    set_last_error("gpu_decompress: a coded stream of a dtype that is never coded", "");
    return kBadArgument;
  }
  const fmt::Layout l = fmt::layout_of(h);
  gpu::DecompressLaunch d{gpu::DecompressParams{in, out, err, h}, nullptr};
  // The fixed code needs no shared tables, so its kernel runs at full occupancy.
  const bool fixed = h.codec == fmt::Codec::Fixed;
  const uint64_t smem = fixed ? 0 : gpu::kGroupsPerCta * gpu::decompress_smem_per_group(h.lanes);
  Ready r;
  if (const int rc = ready(device, gpu::decompress_name(h.dtype, h.codec, h.lanes), smem, &r)) return rc;
  const uint64_t grid = (l.nblocks + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta;
  return run(r, persistent_grid(r, grid, max_sms), smem, stream, d, "launching the decompress kernel");
}

uint64_t gpu_decode_batch_workspace_bytes(int n) {
  return n > 1 ? fmt::align_up(n * sizeof(gpu::DeviceDecode), 16) + 8ull * n : 16;  // one: the fast path's total
}

// Blocks of the output's 32-lane plan (the fixed code's, and v3's rANS):
// as many as or more than the 64-lane plan's, so tickets sized by it serve
// every stream this encoder, or v3's, writes for the output in parallel.
static uint64_t narrow_blocks(fmt::Header e) {
  const uint64_t planned = fmt::layout_of(e).nblocks;
  e.block_log2 = static_cast<uint8_t>(fmt::choose_block_log2(fmt::num_symbols(e.dtype, e.numel), false));
  const uint64_t narrow = fmt::layout_of(e).nblocks;
  return narrow > planned ? narrow : planned;
}

int gpu_decode_batch(const uint8_t* const* ins, const uint64_t* in_lens, uint8_t* const* outs, uint32_t* const* errs,
                     const fmt::Header* expects, int n, void* workspace, void* stream, int device, int max_sms) {
  if (n < 1) return kOk;
  const fmt::DType kernel_dtype = gpu::dtype_token(expects[0].dtype) ? expects[0].dtype : fmt::DType::Invalid;
  const uint64_t ends_at = fmt::align_up(n * sizeof(gpu::DeviceDecode), 16);
  HostTable<gpu::DeviceDecode> t(n, ends_at);
  gpu::DeviceDecode* const jobs = t.jobs;
  uint64_t tickets = 0;
  for (int j = 0; j < n; ++j) {
    const fmt::Header& e = expects[j];
    const fmt::DType kd = gpu::dtype_token(e.dtype) ? e.dtype : fmt::DType::Invalid;
    if (kd != kernel_dtype || reinterpret_cast<uintptr_t>(ins[j]) % fmt::kAlign ||
        reinterpret_cast<uintptr_t>(workspace) % 16) {
      set_last_error("gpu_decode_batch: needs outputs of one coded dtype (or only dtypes never coded), "
                     "16-byte-aligned streams and workspace", "");
      return kBadArgument;
    }
    const fmt::Layout l = fmt::layout_of(e);
    gpu::DeviceDecode& d = jobs[j];
    d.in = ins[j];
    d.in_len = in_lens[j];
    d.out = outs[j];
    d.err = errs[j];
    d.work = e.codec == fmt::Codec::Raw ? gpu::raw_chunks(l) : narrow_blocks(e);
    d.fast_total = n == 1 && e.codec == fmt::Codec::Rans ? static_cast<uint64_t*>(workspace) : nullptr;
    d.expect = e;
    t.ends[j] = tickets += d.work > 0 ? (d.work + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta : 1;
  }
  const bool coded = kernel_dtype != fmt::DType::Invalid;
  const uint64_t smem = coded ? gpu::kGroupsPerCta * gpu::kDecompressSmemPerGroup : 0;
  Ready r;
  if (const int rc = ready(device, gpu::device_decode_name(kernel_dtype), smem, &r)) return rc;
  gpu::DeviceDecodeLaunch launch{};
  launch.one = jobs[0];
  launch.njobs = static_cast<uint32_t>(n);
  launch.tickets = tickets;
  if (n > 1) {
    uint8_t* table = static_cast<uint8_t*>(workspace);
    if (const int e = t.copy_to(table, stream)) return fail(e, "copying the decode table");
    launch.jobs = reinterpret_cast<const gpu::DeviceDecode*>(table);
    launch.ticket_end = reinterpret_cast<const uint64_t*>(table + ends_at);
  }
  int rc = run(r, persistent_grid(r, tickets, max_sms), smem, stream, launch, "launching the decode kernel");
  if (rc || !jobs[0].fast_total) return rc;
  // One expected rANS stream: the general kernel above parsed it and left its total for the fast path.
  gpu::DecompressLaunch f{gpu::DecompressParams{ins[0], outs[0], errs[0], expects[0]}, jobs[0].fast_total};
  Ready fr;
  const uint64_t fsmem = gpu::kGroupsPerCta * gpu::decompress_smem_per_group(expects[0].lanes);
  if ((rc = ready(device, gpu::decompress_name(kernel_dtype, fmt::Codec::Rans, expects[0].lanes), fsmem, &fr))) return rc;
  return run(fr, persistent_grid(fr, (jobs[0].work + gpu::kGroupsPerCta - 1) / gpu::kGroupsPerCta, max_sms), fsmem,
             stream, f, "launching the decode kernel");
}

int gpu_device_info(int device, int* warp_size, int* sm_count) {
  int e = dev::attribute(device, dev::Attr::WarpSize, warp_size);
  if (!e) e = dev::attribute(device, dev::Attr::SmCount, sm_count);
  return e ? fail(e, "querying the device") : static_cast<int>(kOk);
}

// --- weight deltas (delta_gpu.h) ----------------------------------------------
uint64_t gpu_delta_workspace_bytes(uint64_t numel) {
  return 8 * (2 * delta::num_blocks(numel, delta::kMinBlockLog2) + 2);  // a stream's blocks may be that small
}

// A launch of delta kernel `name` over `work` groups (or threads, when
// per_thread) on a persistent grid.
template <class P>
static int delta_launch(const std::string& name, uint64_t work, bool per_thread, P& params, void* stream, int device,
                        int max_sms) {
  Ready r;
  if (const int rc = ready(device, name, 0, &r)) return rc;
  const uint64_t per_cta = per_thread ? gpu::kCtaThreads : gpu::kGroupsPerCta;
  return run(r, persistent_grid(r, work ? (work + per_cta - 1) / per_cta : 1, max_sms), 0, stream, params,
             "launching a delta kernel");
}

int gpu_delta_checksum(const uint8_t* p, uint64_t nbytes, uint32_t* sums, void* stream, int device, int max_sms) {
  gpu::DeltaSumParams q{p, nbytes, sums};
  return delta_launch(gpu::delta_name("checksum", 0), (nbytes + 3) / 4, true, q, stream, device, max_sms);
}

static gpu::DeltaParams delta_params(fmt::DType d, uint64_t numel, uint64_t* ws) {
  gpu::DeltaParams p{};
  p.numel = numel;
  p.log2 = delta::kBlockLog2;
  p.w = delta::width_bits(d);
  p.nblocks = delta::num_blocks(numel, p.log2);
  p.ws = ws;
  return p;
}

static int delta_table(const uint8_t* entries, const delta::Header& h, uint64_t* ws, uint32_t* err, bool check,
                       void* stream, int device) {
  gpu::DeltaTableParams t{};
  t.entries = entries;
  t.numel = h.numel;
  t.log2 = h.block_log2;
  t.w = delta::width_bits(h.dtype);
  t.nblocks = delta::num_blocks(h.numel, h.block_log2);
  t.ws = ws;
  t.err = err;
  t.expect_total = h.total_bytes;
  t.expect_changed = h.changed;
  t.check = check;
  Ready r;
  if (const int rc = ready(device, gpu::delta_name("table", 0), 0, &r)) return rc;
  return run(r, Grid{1, 1}, 0, stream, t, "launching the delta table kernel");
}

int gpu_delta_plan(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, uint64_t* ws,
                   void* stream, int device, int max_sms) {
  gpu::DeltaParams p = delta_params(d, numel, ws);
  p.base = base, p.target = target;
  if (const int rc = delta_launch(gpu::delta_name("plan", p.w), p.nblocks, false, p, stream, device, max_sms)) return rc;
  delta::Header h;
  h.dtype = d, h.numel = numel;
  return delta_table(reinterpret_cast<const uint8_t*>(gpu::delta_entries(ws, p.nblocks)), h, ws, nullptr, false,
                     stream, device);
}

int gpu_delta_write(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, uint8_t* out,
                    uint64_t* ws, void* stream, int device, int max_sms) {
  gpu::DeltaParams p = delta_params(d, numel, ws);
  p.base = base, p.target = target, p.out = out;
  return delta_launch(gpu::delta_name("write", p.w), p.nblocks, false, p, stream, device, max_sms);
}

int gpu_delta_table(const uint8_t* stream_bytes, const uint8_t* head, uint64_t* ws, uint32_t* err, void* stream,
                    int device) {
  delta::Header h;
  if (delta::parse_header(head, delta::kHeaderBytes, ~0ull, &h) != delta::Error::Ok) {
    set_last_error("gpu_delta_table: the host did not validate this header", "");
    return kBadArgument;
  }
  return delta_table(stream_bytes + delta::kHeaderBytes, h, ws, err, true, stream, device);
}

int gpu_delta_decode(uint8_t* base, const uint8_t* stream_bytes, const uint8_t* head, uint64_t* ws, uint32_t* err,
                     bool write, void* stream, int device, int max_sms) {
  delta::Header h;
  if (delta::parse_header(head, delta::kHeaderBytes, ~0ull, &h) != delta::Error::Ok) {
    set_last_error("gpu_delta_decode: the host did not validate this header", "");
    return kBadArgument;
  }
  gpu::DeltaParams p = delta_params(h.dtype, h.numel, ws);
  p.log2 = h.block_log2;
  p.nblocks = delta::num_blocks(h.numel, h.block_log2);
  p.out = base, p.stream = stream_bytes, p.err = err, p.total = h.total_bytes, p.write = write;
  return delta_launch(gpu::delta_name("decode", p.w), p.nblocks, false, p, stream, device, max_sms);
}

// --- staging copies for a transport (gpu_runtime.h) ------------------------
static int ok_or(int e, const char* what) { return e ? fail(e, what) : static_cast<int>(kOk); }

int gpu_set_device(int device) { return ok_or(dev::use_device(device), "selecting the device"); }

int gpu_stream_new(void** stream) { return ok_or(dev::stream_create(stream), "creating the staging stream"); }

int gpu_stream_free(void* stream) { return ok_or(dev::stream_destroy(stream), "freeing a stream"); }

int gpu_event_new(void** ev) { return ok_or(dev::event_create(ev), "creating an event"); }

int gpu_event_free(void* ev) { return ok_or(dev::event_destroy(ev), "freeing an event"); }

int gpu_copy_async(void* dst, const void* src, uint64_t n, void* stream, void* ev) {
  int e = dev::memcpy_async(dst, src, n, stream);
  if (!e) e = dev::event_record(ev, stream);
  return ok_or(e, "queueing a staging copy");
}

int gpu_event_done(void* ev) {
  const int e = dev::event_query(ev);
  if (e == dev::kNotReady) return 0;
  return e ? fail(e, "a staging copy failed") : 1;
}

int gpu_stream_after(void* stream, void* user_stream, void* ev) {
  int e = dev::event_record(ev, user_stream);
  if (!e) e = dev::stream_wait(stream, ev);
  return ok_or(e, "ordering the staging stream after the caller's");
}

int gpu_pinned_alloc(void** p, uint64_t n) { return ok_or(dev::host_alloc(p, n), "allocating pinned staging memory"); }

int gpu_pinned_free(void* p) { return ok_or(dev::host_free(p), "freeing pinned staging memory"); }

}  // namespace pz
