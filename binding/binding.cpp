// The one Python binding file: thin wrappers over the codec's launchers
// (kernels/launch.h) and the fabric engine (transport/engine.h), the one file
// that sees both. Pointers arrive as integers from torch tensors the Python
// layer has already validated.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/device_api.h"
#include "kernels/launch.h"
#include "portable_zip/block.h"
#include "portable_zip/cpu_simd.h"
#include "portable_zip/delta_gpu.h"
#if defined(PZ_WITH_FABRIC)
#include "transport/engine.h"
#endif
#include "transport/iface.h"
#include "transport/watch.h"

namespace nb = nanobind;
using namespace pz;

namespace {

struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// Tests only (_C.test_plan_override): every rANS plan of this process takes
// this block size and lane count, so small tensors reach the 64-lane coders
// that the encoder picks only for 2^27 symbols and more. 0: the encoder's plan.
uint8_t g_plan_block_log2 = 0, g_plan_lanes = fmt::kLanes;

fmt::Header plan(int dtype, uint64_t numel, const std::vector<int64_t>& shape, int codec = 1) {
  if (dtype <= 0 || dtype >= static_cast<int>(fmt::DType::Count)) throw std::invalid_argument("unknown dtype code");
  if (shape.size() > fmt::kMaxDims) throw std::invalid_argument("portable_zip supports at most 16 dimensions");
  if (codec <= 0 || codec >= fmt::kNumCodecs) throw std::invalid_argument("unknown codec code");
  // Byte counts of larger tensors could wrap 64 bits; no real tensor is near.
  if (numel > fmt::kMaxNumel)
    throw std::overflow_error("portable_zip supports at most 2^48 elements per tensor, got " + std::to_string(numel));
  for (const int64_t d : shape)
    if (d < 0 || static_cast<uint64_t>(d) > fmt::kMaxNumel)
      throw std::overflow_error("shape entries must be in [0, 2^48], got " + std::to_string(d));
  fmt::Header h = fmt::plan_header(static_cast<fmt::DType>(dtype), numel, shape.data(), static_cast<int>(shape.size()),
                                   static_cast<fmt::Codec>(codec));
  if (g_plan_block_log2 && h.codec == fmt::Codec::Rans) h.block_log2 = g_plan_block_log2, h.lanes = g_plan_lanes;
  return h;
}

fmt::Header parse(const nb::bytes& data, uint64_t stream_len) {
  fmt::Header h;
  const auto e = fmt::parse_header(static_cast<const uint8_t*>(data.data()), data.size(), stream_len, &h);
  if (e != fmt::ParseError::Ok) {
    std::string msg = fmt::parse_error_text(e);
    if (e == fmt::ParseError::BadVersion)  // parse_header filled in the field it rejected
      msg += " " + std::to_string(h.version) + "; this build reads versions " + std::to_string(fmt::kMinVersion) + " to " +
             std::to_string(fmt::kVersion);
    if (e == fmt::ParseError::Truncated)
      msg += " (" + std::to_string(stream_len) + " bytes, header says " + std::to_string(h.total_bytes) + ")";
    throw FormatError(msg);
  }
  return h;
}

std::string decode_error_text(uint32_t bits) {
  std::string s;
  auto add = [&](uint32_t bit, const char* text) {
    if (bits & bit) s += (s.empty() ? "" : "; ") + std::string(text);
  };
  add(kErrOffsets, "block offset table is out of order or points outside the stream");
  add(kErrTable, "a block's frequency table is malformed");
  add(kErrSegment, "a block segment is too short for its contents or has an unknown mode");
  add(kErrStream, "a block's coded data is inconsistent (corrupted coded bytes)");
  add(kErrChecksum, "decoded data does not match its checksum (corrupted raw or coded bytes)");
  add(kErrBool, "a bool stream holds a byte other than 0 or 1");
  if (bits & kErrHeader) {
    const auto pe = static_cast<fmt::ParseError>((bits >> kParseErrorShift) & 0xff);
    add(kErrHeader, (std::string("bad header: ") + fmt::parse_error_text(pe)).c_str());
  }
  add(kErrMismatch, "the stream holds another dtype or shape than the output tensor");
  return "corrupted stream: " + s;
}

void check(int rc) {
  if (rc != kOk) throw std::runtime_error(last_error_message());
}

}  // namespace

NB_MODULE(_C, m) {
  // A Communicator left open at exit keeps its engine and watch alive (their
  // daemon threads hold them): the OS reclaims them; a leak report would read as a bug.
  nb::set_leak_warnings(false);
  nb::exception<FormatError>(m, "FormatError", PyExc_ValueError);

  m.def("max_compressed_size", [](int dtype, uint64_t numel, const std::vector<int64_t>& shape) {
    return fmt::max_stream_bytes(plan(dtype, numel, shape));
  });

  m.def("parse_header", [](nb::bytes data, uint64_t stream_len) {
    const fmt::Header h = parse(data, stream_len);
    const fmt::Layout l = fmt::layout_of(h);
    nb::dict d;
    d["version"] = h.version;
    d["dtype"] = static_cast<int>(h.dtype);
    d["codec"] = static_cast<int>(h.codec);
    d["shape"] = std::vector<int64_t>(h.shape, h.shape + h.ndim);
    d["numel"] = h.numel;
    d["total_bytes"] = h.total_bytes;
    d["block_symbols"] = h.codec != fmt::Codec::Raw ? (1ull << h.block_log2) : 0ull;
    d["lanes"] = h.lanes;
    d["nblocks"] = l.nblocks;
    d["raw_begin"] = l.raw_begin;
    d["raw_end"] = l.raw_end;
    d["coded_begin"] = l.coded_begin;
    d["header_bytes"] = l.header_bytes;
    d["checksums"] = h.version >= 2;
    return d;
  });

  m.def("decode_error_text", &decode_error_text);
  m.def("test_plan_override", [](int block_log2, int lanes) {
    if (block_log2 && (block_log2 < fmt::kMinBlockLog2 || block_log2 > fmt::kEncoderMaxBlockLog2 ||
                       (lanes != fmt::kLanes && lanes != fmt::kWideLanes)))
      throw std::invalid_argument("test_plan_override: block_log2 in [10, 15] (0: off), lanes 32 or 64");
    g_plan_block_log2 = static_cast<uint8_t>(block_log2);
    g_plan_lanes = static_cast<uint8_t>(block_log2 ? lanes : fmt::kLanes);
  });
  m.def("cpu_simd", [] { return std::string(cpu::simd::avx2_enabled() ? "avx2" : "scalar"); });

  // Region offsets that depend only on dtype, numel and ndim: what a peer can
  // post receives for before it sees the stream's header.
  m.def("stream_layout", [](int dtype, uint64_t numel, const std::vector<int64_t>& shape) {
    const fmt::Header h = plan(dtype, numel, shape);
    const fmt::Layout l = fmt::layout_of(h);
    nb::dict d;
    d["coded"] = h.codec != fmt::Codec::Raw;
    d["raw_begin"] = l.raw_begin;
    d["raw_end"] = l.raw_end;
    d["max_total"] = fmt::max_stream_bytes(h);
    return d;
  });

  // Header bytes (up to the payload) of a stream stored raw, or None when the
  // tensor is entropy-coded: lets GPU callers store raw tensors with copies only.
  m.def("raw_header", [](int dtype, uint64_t numel, const std::vector<int64_t>& shape) -> nb::object {
    fmt::Header h = plan(dtype, numel, shape);
    if (h.codec != fmt::Codec::Raw) return nb::none();
    const fmt::Layout l = fmt::layout_of(h);
    h.total_bytes = l.coded_begin;
    std::vector<uint8_t> head(l.raw_begin);
    fmt::write_header(h, head.data());
    return nb::bytes(reinterpret_cast<const char*>(head.data()), head.size());
  });

  m.def("advise_huge_pages", [](uintptr_t p, uint64_t n) { cpu_advise_huge_pages(ptr<uint8_t>(p), n); });

  m.def("compress_cpu", [](uintptr_t in, int dtype, uint64_t numel, const std::vector<int64_t>& shape, uintptr_t out,
                           int threads, int codec) {
    const fmt::Header h = plan(dtype, numel, shape, codec);
    nb::gil_scoped_release release;
    return cpu_compress(ptr<const uint8_t>(in), h, ptr<uint8_t>(out), threads);
  }, nb::arg("in"), nb::arg("dtype"), nb::arg("numel"), nb::arg("shape"), nb::arg("out"), nb::arg("threads"),
     nb::arg("codec") = 1);

  // The trimmed stream as a torch tensor that owns its mapping (no copy).
  m.def("compress_cpu_exact", [](uintptr_t in, int dtype, uint64_t numel, const std::vector<int64_t>& shape, int threads,
                                 int codec) {
    const fmt::Header h = plan(dtype, numel, shape, codec);
    uint64_t total = 0, mapped = 0;
    uint8_t* p;
    {
      nb::gil_scoped_release release;
      p = cpu_compress_mapped(ptr<const uint8_t>(in), h, threads, &total, &mapped);
    }
    if (!p) throw std::runtime_error(last_error_message());
    struct Mapping {
      uint8_t* p;
      uint64_t n;
    };
    nb::capsule owner(new Mapping{p, mapped}, [](void* m) noexcept {
      cpu_release_mapped(static_cast<Mapping*>(m)->p, static_cast<Mapping*>(m)->n);
      delete static_cast<Mapping*>(m);
    });
    return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::c_contig>(p, {static_cast<size_t>(total)}, owner);
  }, nb::arg("in"), nb::arg("dtype"), nb::arg("numel"), nb::arg("shape"), nb::arg("threads"), nb::arg("codec") = 1);

  m.def("decompress_cpu", [](nb::bytes head, uintptr_t in, uint64_t in_len, uintptr_t out, int threads) {
    const fmt::Header h = parse(head, in_len);
    uint32_t err;
    {
      nb::gil_scoped_release release;
      err = cpu_decompress(ptr<const uint8_t>(in), h, ptr<uint8_t>(out), threads);
    }
    if (err) throw FormatError(decode_error_text(err));
  });

  // Weight deltas (delta.h). Pointers come from tensors delta.py checked.
  m.def("delta_checksum_cpu", [](uintptr_t p, uint64_t nbytes, int threads) {
    nb::gil_scoped_release release;
    return cpu_delta_checksum(ptr<const uint8_t>(p), nbytes, threads);
  });
  m.def("delta_max_size", [](int dtype, uint64_t numel) {
    if (dtype <= 0 || dtype >= static_cast<int>(fmt::DType::Count) ||
        !delta::width_bits(static_cast<fmt::DType>(dtype)))
      throw std::invalid_argument("delta: dtype is not one deltas code");
    if (numel > fmt::kMaxNumel) throw std::overflow_error("delta: at most 2^48 elements");
    return delta::max_stream_bytes(static_cast<fmt::DType>(dtype), numel);
  });
  // The stream as a torch tensor owning its malloc'd buffer (no copy).
  m.def("delta_encode_cpu", [](uintptr_t base, uintptr_t target, int dtype, uint64_t numel, int threads) {
    uint64_t total = 0;
    uint8_t* p;
    {
      nb::gil_scoped_release release;
      p = cpu_delta_encode(ptr<const uint8_t>(base), ptr<const uint8_t>(target), static_cast<fmt::DType>(dtype), numel,
                           threads, &total);
    }
    if (!p) throw std::runtime_error(last_error_message());
    nb::capsule owner(p, [](void* q) noexcept { std::free(q); });
    return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::c_contig>(p, {static_cast<size_t>(total)}, owner);
  });
  // 0 when rebuilt and verified, else a delta::Error code (delta_error_text).
  m.def("delta_apply_cpu", [](uintptr_t base, int dtype, uint64_t numel, uintptr_t stream, uint64_t len, int threads) {
    nb::gil_scoped_release release;
    return cpu_delta_apply(ptr<uint8_t>(base), static_cast<fmt::DType>(dtype), numel, ptr<const uint8_t>(stream), len,
                           threads);
  });
  m.def("delta_error_text", [](uint32_t e) { return std::string(delta::error_text(static_cast<delta::Error>(e))); });
  m.def("delta_parse_header", [](nb::bytes head, uint64_t stream_len) {
    delta::Header h;
    const delta::Error e = delta::parse_header(static_cast<const uint8_t*>(head.data()), head.size(), stream_len, &h);
    if (e != delta::Error::Ok) throw FormatError(delta::error_text(e));
    // In delta.py's _HEADER_FIELDS order.
    return nb::make_tuple(h.version, static_cast<int>(h.dtype), h.block_log2, h.total_bytes, h.numel, h.changed,
                          h.base_sum, h.target_sum, h.payload_bytes);
  });
  m.attr("delta_header_bytes") = delta::kHeaderBytes;
  m.attr("delta_block_log2") = delta::kBlockLog2;
  m.attr("delta_error_base_mismatch") = static_cast<int>(delta::Error::BaseMismatch);
  m.attr("delta_error_mismatch") = static_cast<int>(delta::Error::Mismatch);
  m.attr("delta_error_target_mismatch") = static_cast<int>(delta::Error::TargetMismatch);
  m.def("delta_finish_checksum", &delta::finish_checksum);

  m.attr("format_version") = fmt::kVersion;
  m.attr("lanes") = fmt::kLanes;
  // Where a stream's total size lives (a u64, little-endian, header included):
  // buf[total_bytes_offset : total_bytes_offset + 8] of a stream at least
  // fixed_header_bytes long, read without parsing the header by hand.
  m.attr("total_bytes_offset") = fmt::kTotalBytesOffset;
  m.attr("fixed_header_bytes") = fmt::kFixedHeaderBytes;

  // The GPU vendor's runtime is loaded at run time, by name ("cuda", "hip"),
  // with the directory of device code the package ships beside _C.
  auto vendor_of = [](const std::string& name) {
    if (name == "cuda") return dev::Vendor::Cuda;
    if (name == "hip") return dev::Vendor::Hip;
    throw std::invalid_argument("unknown GPU vendor '" + name + "' (cuda or hip)");
  };
  m.def("gpu_load", [vendor_of](const std::string& vendor, const std::string& code_dir) {
    return dev::load(vendor_of(vendor), code_dir);
  });
  m.def("gpu_vendor", [] { return std::string(dev::vendor_name(dev::vendor())); });
  m.def("gpu_code_files", [vendor_of](const std::string& vendor, const std::string& code_dir) {
    return dev::code_files(vendor_of(vendor), code_dir);
  });
  m.def("pick_cuda_image", &dev::pick_cuda_image);
  m.def("gpu_image", &dev::loaded_image);
  m.def("bundle_targets", [](nb::bytes b) { return dev::bundle_targets(std::string(b.c_str(), b.size())); });
  m.def("compress_workspace_bytes", [](int dtype, uint64_t numel, const std::vector<int64_t>& shape, int codec,
                                       int device) {
    uint64_t bytes;
    check(gpu_compress_workspace_bytes(plan(dtype, numel, shape, codec), device, &bytes));
    return bytes;
  }, nb::arg("dtype"), nb::arg("numel"), nb::arg("shape"), nb::arg("codec") = 1, nb::arg("device") = -1);
  m.def("compress_gpu", [](uintptr_t in, int dtype, uint64_t numel, const std::vector<int64_t>& shape, uintptr_t out,
                           uintptr_t workspace, uintptr_t stream, int max_sms, int codec, int device) {
    check(gpu_compress(ptr<const uint8_t>(in), plan(dtype, numel, shape, codec), ptr<uint8_t>(out),
                       ptr<void>(workspace), ptr<void>(stream), device, max_sms));
  }, nb::arg("in"), nb::arg("dtype"), nb::arg("numel"), nb::arg("shape"), nb::arg("out"), nb::arg("workspace"),
     nb::arg("stream"), nb::arg("max_sms") = 0, nb::arg("codec") = 1, nb::arg("device") = -1);
  // A batch of same-dtype tensors: one launch. shapes[j] is tensor j's shape.
  auto plans = [](int dtype, const std::vector<uint64_t>& numels, const std::vector<std::vector<int64_t>>& shapes,
                  int codec) {
    if (numels.size() != shapes.size()) throw std::invalid_argument("numels and shapes differ in length");
    std::vector<fmt::Header> hs;
    for (size_t j = 0; j < numels.size(); ++j) hs.push_back(plan(dtype, numels[j], shapes[j], codec));
    return hs;
  };
  m.def("compress_batch_workspace_bytes", [plans](int dtype, const std::vector<uint64_t>& numels,
                                                  const std::vector<std::vector<int64_t>>& shapes, int codec,
                                                  int device) {
    const auto hs = plans(dtype, numels, shapes, codec);
    uint64_t bytes;
    check(gpu_compress_batch_workspace_bytes(hs.data(), static_cast<int>(hs.size()), device, &bytes));
    return bytes;
  }, nb::arg("dtype"), nb::arg("numels"), nb::arg("shapes"), nb::arg("codec") = 1, nb::arg("device") = -1);
  m.def("compress_gpu_batch", [plans](const std::vector<uintptr_t>& ins, int dtype, const std::vector<uint64_t>& numels,
                                      const std::vector<std::vector<int64_t>>& shapes, const std::vector<uintptr_t>& outs,
                                      uintptr_t workspace, uintptr_t stream, int max_sms, int codec, int device) {
    const auto hs = plans(dtype, numels, shapes, codec);
    if (ins.size() != hs.size() || outs.size() != hs.size()) throw std::invalid_argument("batch lists differ in length");
    std::vector<const uint8_t*> in(ins.size());
    std::vector<uint8_t*> out(outs.size());
    for (size_t j = 0; j < ins.size(); ++j) in[j] = ptr<const uint8_t>(ins[j]), out[j] = ptr<uint8_t>(outs[j]);
    check(gpu_compress_batch(in.data(), hs.data(), out.data(), static_cast<int>(hs.size()), ptr<void>(workspace),
                             ptr<void>(stream), device, max_sms));
  }, nb::arg("ins"), nb::arg("dtype"), nb::arg("numels"), nb::arg("shapes"), nb::arg("outs"), nb::arg("workspace"),
     nb::arg("stream"), nb::arg("max_sms") = 0, nb::arg("codec") = 1, nb::arg("device") = -1);
  m.def("decompress_gpu", [](nb::bytes head, uintptr_t in, uint64_t in_len, uintptr_t out, uintptr_t err,
                             uintptr_t stream, int max_sms, int device) {
    check(gpu_decompress(ptr<const uint8_t>(in), parse(head, in_len), ptr<uint8_t>(out), ptr<uint32_t>(err),
                         ptr<void>(stream), device, max_sms));
  }, nb::arg("head"), nb::arg("in"), nb::arg("in_len"), nb::arg("out"), nb::arg("err"), nb::arg("stream"),
     nb::arg("max_sms") = 0, nb::arg("device") = -1);
  // Decodes whose headers the kernel parses (no host sync): outputs of one
  // coded dtype, or of dtypes never coded; job j expects dtypes[j], shapes[j].
  m.def("decode_batch_workspace_bytes", [](int n) { return gpu_decode_batch_workspace_bytes(n); });
  m.def("decode_gpu_batch", [](const std::vector<uintptr_t>& ins, const std::vector<uint64_t>& in_lens,
                               const std::vector<uintptr_t>& outs, const std::vector<uintptr_t>& errs,
                               const std::vector<int>& dtypes, const std::vector<uint64_t>& numels,
                               const std::vector<std::vector<int64_t>>& shapes, uintptr_t workspace, uintptr_t stream,
                               int max_sms, int device) {
    const size_t n = ins.size();
    if (in_lens.size() != n || outs.size() != n || errs.size() != n || dtypes.size() != n || numels.size() != n ||
        shapes.size() != n)
      throw std::invalid_argument("decode batch lists differ in length");
    std::vector<fmt::Header> hs;
    std::vector<const uint8_t*> in(n);
    std::vector<uint8_t*> out(n);
    std::vector<uint32_t*> err(n);
    for (size_t j = 0; j < n; ++j) {
      hs.push_back(plan(dtypes[j], numels[j], shapes[j]));
      in[j] = ptr<const uint8_t>(ins[j]), out[j] = ptr<uint8_t>(outs[j]), err[j] = ptr<uint32_t>(errs[j]);
    }
    check(gpu_decode_batch(in.data(), in_lens.data(), out.data(), err.data(), hs.data(), static_cast<int>(n),
                           ptr<void>(workspace), ptr<void>(stream), device, max_sms));
  }, nb::arg("ins"), nb::arg("in_lens"), nb::arg("outs"), nb::arg("errs"), nb::arg("dtypes"), nb::arg("numels"),
     nb::arg("shapes"), nb::arg("workspace"), nb::arg("stream"), nb::arg("max_sms") = 0, nb::arg("device") = -1);
  // What the GPU codec launches of this process used since the last reset
  // (launch.h, LaunchReport): {"launches", "max_grid", "max_sms",
  // "max_grid_sms"}. max_sms is the most SMs a grid was sized for (a budget,
  // or the device's SM count); reset=True zeroes the counts after reading them.
  m.def("launch_report", [](bool reset) {
    const LaunchReport r = gpu_launch_report(reset);
    nb::dict d;
    d["launches"] = r.launches;
    d["max_grid"] = r.max_grid;
    d["max_sms"] = r.max_sms;
    d["max_grid_sms"] = r.max_grid_sms;
    return d;
  }, nb::arg("reset") = false);
  // Weight deltas on the GPU (launch.h); delta.py sequences the calls.
  m.def("delta_workspace_bytes", &gpu_delta_workspace_bytes);
  m.def("delta_checksum_gpu", [](uintptr_t p, uint64_t nbytes, uintptr_t sums, uintptr_t stream, int max_sms,
                                 int device) {
    check(gpu_delta_checksum(ptr<const uint8_t>(p), nbytes, ptr<uint32_t>(sums), ptr<void>(stream), device, max_sms));
  });
  m.def("delta_plan_gpu", [](uintptr_t base, uintptr_t target, int dtype, uint64_t numel, uintptr_t ws,
                             uintptr_t stream, int max_sms, int device) {
    check(gpu_delta_plan(ptr<const uint8_t>(base), ptr<const uint8_t>(target), static_cast<fmt::DType>(dtype), numel,
                         ptr<uint64_t>(ws), ptr<void>(stream), device, max_sms));
  });
  m.def("delta_write_gpu", [](uintptr_t base, uintptr_t target, int dtype, uint64_t numel, uintptr_t out, uintptr_t ws,
                              uintptr_t stream, int max_sms, int device) {
    check(gpu_delta_write(ptr<const uint8_t>(base), ptr<const uint8_t>(target), static_cast<fmt::DType>(dtype), numel,
                          ptr<uint8_t>(out), ptr<uint64_t>(ws), ptr<void>(stream), device, max_sms));
  });
  m.def("delta_table_gpu", [](uintptr_t in, nb::bytes head, uintptr_t ws, uintptr_t err, uintptr_t stream, int device) {
    if (head.size() < static_cast<size_t>(delta::kHeaderBytes)) throw FormatError(delta::error_text(delta::Error::TooShort));
    check(gpu_delta_table(ptr<const uint8_t>(in), static_cast<const uint8_t*>(head.data()), ptr<uint64_t>(ws),
                          ptr<uint32_t>(err), ptr<void>(stream), device));
  });
  m.def("delta_decode_gpu", [](uintptr_t base, uintptr_t in, nb::bytes head, uintptr_t ws, uintptr_t err, bool write,
                               uintptr_t stream, int max_sms, int device) {
    if (head.size() < static_cast<size_t>(delta::kHeaderBytes)) throw FormatError(delta::error_text(delta::Error::TooShort));
    check(gpu_delta_decode(ptr<uint8_t>(base), ptr<const uint8_t>(in), static_cast<const uint8_t*>(head.data()),
                           ptr<uint64_t>(ws), ptr<uint32_t>(err), write, ptr<void>(stream), device, max_sms));
  });
  // The error code of a GPU apply's checks before it writes (0: go ahead).
  m.def("delta_gpu_verdict", [](nb::bytes head, uint32_t err, uint32_t body_sum, uint64_t base_sum) {
    delta::Header h;
    const delta::Error e = delta::parse_header(static_cast<const uint8_t*>(head.data()), head.size(), ~0ull, &h);
    if (e != delta::Error::Ok) return static_cast<uint32_t>(e);
    return static_cast<uint32_t>(
        delta::check_verdict(h, body_sum, err, gpu::kDeltaErrTable, gpu::kDeltaErrBlock, base_sum));
  });
  // A stream's header from the GPU encoder's totals and checksums.
  m.def("delta_header", [](int dtype, uint64_t numel, uint64_t changed, uint64_t total, uint64_t base_sum,
                           uint64_t target_sum, uint32_t body_sum) {
    delta::Header h;
    h.dtype = static_cast<fmt::DType>(dtype);
    h.numel = numel, h.changed = changed, h.total_bytes = total;
    h.payload_bytes = total - delta::payload_begin(delta::num_blocks(numel, h.block_log2));
    h.base_sum = base_sum, h.target_sum = target_sum, h.body_sum = body_sum;
    uint8_t out[delta::kHeaderBytes];
    delta::write_header(h, out);
    return nb::bytes(reinterpret_cast<const char*>(out), sizeof out);
  });
  m.def("device_info", [](int device) {
    int warp = 0, sms = 0;
    check(gpu_device_info(device, &warp, &sms));
    return nb::make_tuple(warp, sms);
  });

#if defined(PZ_WITH_FABRIC)
  // The fabric engine: Python posts whole transfers (kind, peer, pointer,
  // bytes, on GPU) and waits; chunking, rails and staging run in C++.
  using fabric::Engine;
  m.attr("has_fabric") = true;
  m.def("fabric_probe", &fabric::probe);
  nb::class_<Engine>(m, "FabricEngine")
      .def("__init__", [](Engine* self, const std::string& provider, int rails, uint64_t chunk, int depth,
                          bool stage_host, int device, int rank, int world, bool same_host, int spin,
                          const nb::bytes& secret, const std::string& iface, int64_t window) {
        fabric::Config c;
        c.provider = provider, c.rails = rails, c.chunk = chunk, c.depth = depth, c.stage_host = stage_host;
        c.device = device, c.rank = rank, c.world = world, c.same_host = same_host, c.spin = spin;
        c.secret.assign(static_cast<const char*>(secret.data()), secret.size()), c.iface = iface, c.window = window;
        nb::gil_scoped_release release;
        new (self) Engine(c);
      }, nb::arg("provider"), nb::arg("rails"), nb::arg("chunk"), nb::arg("depth"), nb::arg("stage_host"),
      nb::arg("device"), nb::arg("rank"), nb::arg("world"), nb::arg("same_host"), nb::arg("spin"), nb::arg("secret"),
      nb::arg("iface"), nb::arg("window") = -1)
      .def("address", [](const Engine& e) {
        const std::string a = e.address();
        return nb::bytes(a.data(), a.size());
      })
      .def("connect", [](Engine& e, const std::vector<nb::bytes>& addrs) {
        std::vector<std::string> v;
        for (const auto& a : addrs) v.emplace_back(static_cast<const char*>(a.data()), a.size());
        e.connect(v);
      })
      .def("post", [](Engine& e, const std::vector<std::tuple<int, int, uintptr_t, uint64_t, bool>>& ops,
                      uintptr_t stream) {
        std::vector<fabric::Op> v;
        for (const auto& [kind, peer, p, len, device] : ops) {
          if (kind < 0 || kind > 3) throw std::invalid_argument("fabric: unknown transfer kind");
          v.push_back({static_cast<fabric::Kind>(kind), peer, ptr<uint8_t>(p), len, device});
        }
        return e.post(v, ptr<void>(stream));
      })
      // The bytes each op moved, or None when the wait timed out.
      .def("wait", [](Engine& e, uint64_t batch, double timeout) -> nb::object {
        std::vector<uint64_t> lens;
        int rc;
        {
          nb::gil_scoped_release release;
          rc = e.wait(batch, timeout, &lens);
        }
        if (rc) return nb::none();
        return nb::cast(lens);
      })
      .def("info", &Engine::info)
      .def("abort", [](Engine& e, const std::string& why) {
        nb::gil_scoped_release release;
        e.abort(why);
      })
      .def("drain", [](Engine& e, double timeout_s) {
        nb::gil_scoped_release release;
        return e.drain(timeout_s);
      })
      .def("close", [](Engine& e) {
        nb::gil_scoped_release release;
        e.close();
      });
#else
  m.attr("has_fabric") = false;
  m.def("fabric_probe", [] { return std::string("this build has no fabric transport (libfabric headers were not found "
                                                "at build time: install libfabric-dev and rebuild)"); });
#endif

  // (interface, numeric address) pairs of this host: comm/address.py picks from them.
  m.def("interfaces", &net::interfaces);

  // The liveness watch (transport/watch.h): a heartbeat thread per
  // Communicator; dead() is None or (group rank, why).
  nb::class_<watch::Watch>(m, "LivenessWatch")
      .def("__init__", [](watch::Watch* self, int rank, const std::vector<int64_t>& global, nb::bytes secret,
                          double silence_s, const std::string& host, const std::string& iface, int port_lo,
                          int port_hi) {
        new (self) watch::Watch(rank, global, std::string(static_cast<const char*>(secret.data()), secret.size()),
                                silence_s, host, iface, port_lo, port_hi);
      }, nb::arg("rank"), nb::arg("global_ranks"), nb::arg("secret"), nb::arg("silence_s"), nb::arg("host"),
         nb::arg("iface"), nb::arg("port_lo") = 0, nb::arg("port_hi") = 0)
      .def("address", &watch::Watch::address)
      .def("connect", &watch::Watch::connect, nb::call_guard<nb::gil_scoped_release>())
      .def("connect_for", &watch::Watch::connect_for, nb::call_guard<nb::gil_scoped_release>())
      .def("missing", &watch::Watch::missing)
      .def("dead", [](const watch::Watch& w) -> nb::object {
        int rank;
        std::string why;
        if (!w.failed(&rank, &why)) return nb::none();
        return nb::make_tuple(rank, why);
      })
      .def("departed", [](const watch::Watch& w) {
        nb::list out;
        for (const auto& [rank, why] : w.departed()) out.append(nb::make_tuple(rank, why));
        return out;
      })
      .def("expect", &watch::Watch::expect)
#if defined(PZ_WITH_FABRIC)
      // A failure aborts the engine: its blocked wait raises why at once.
      .def("attach", [](watch::Watch& w, fabric::Engine& e) {
        e.set_watched([&w] { return w.peer_down_now(); });
        w.attach([&e](const std::string& why) { e.abort(why); }, [&e](int peer, bool quiet) { e.peer_gone(peer, quiet); },
                 [&e] { return e.quiet(); });
      }, nb::keep_alive<1, 2>())
#endif
      .def("close", &watch::Watch::close, nb::call_guard<nb::gil_scoped_release>());
}
