// CPU drivers of the weight-delta codec (delta.h): threads over blocks and
// over the checksum's units; every byte comes from delta.h's shared code.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <string>
#include <vector>

#include "launch.h"
#include "portable_zip/cpu_codec.h"  // cpu::parallel_for
#include "portable_zip/delta.h"

namespace pz {

namespace {

using delta::Entry;

// The two checksum sums of units [a, z) of nbytes bytes at p.
PZ_HOST_SIMD_CLONES void sum_units(const uint8_t* p, uint64_t nbytes, uint64_t a, uint64_t z, uint32_t* lo,
                                   uint32_t* hi) {
  const uint64_t full = nbytes / 4 < z ? nbytes / 4 : z;
  uint32_t l = 0, h = 0;
  // Runs of 2^32 units share the index's high half: a 32-bit loop the compiler vectorizes.
  for (uint64_t run = a; run < full;) {
    const uint64_t end = (run | 0xFFFFFFFFull) + 1 < full ? (run | 0xFFFFFFFFull) + 1 : full;
    const uint32_t mix = delta::unit_index(run) ^ static_cast<uint32_t>(run);
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p + 4 * run);  // little-endian hosts (as the whole codec)
    const uint32_t count = static_cast<uint32_t>(end - run), lo0 = static_cast<uint32_t>(run);
    for (uint32_t k = 0; k < count; ++k) {
      uint32_t u;
      memcpy(&u, q + k, 4);
      const uint32_t ix = (lo0 + k) ^ mix;
      l += delta::term_lo(u, ix);
      h += delta::term_hi(u, ix);
    }
    run = end;
  }
  for (uint64_t i = full > a ? full : a; i < z; ++i) {
    const uint32_t u = delta::tail_unit(p, nbytes, i), ix = delta::unit_index(i);
    l += delta::term_lo(u, ix);
    h += delta::term_hi(u, ix);
  }
  *lo = l, *hi = h;
}

uint64_t checksum(const uint8_t* p, uint64_t nbytes, int threads) {
  const uint64_t units = (nbytes + 3) / 4;
  // Chunks of 1 MiB at least: a thread per chunk pays off only past that.
  const uint64_t chunks = (units + (1u << 18) - 1) >> 18;
  std::atomic<uint32_t> lo{0}, hi{0};
  cpu::parallel_for(chunks, threads, [&](int, uint64_t c0, uint64_t c1) {
    uint32_t l, h;
    sum_units(p, nbytes, c0 << 18, c1 << 18 < units ? c1 << 18 : units, &l, &h);
    lo += l, hi += h;
  });
  return delta::finish_checksum(lo, hi, nbytes);
}

// A block's changed elements in one pass: positions and zigzag values, in
// order. 32-byte runs with no change (most of them at a small learning rate)
// are skipped whole; in the others a bit mask of the changes is walked.
template <class T>
PZ_FORCE_INLINE uint32_t collect(const T* b, const T* t, uint32_t n, int w, uint16_t* pos, uint32_t* z) {
  constexpr uint32_t kRun = 32 / sizeof(T);
  uint32_t c = 0, i = 0;
  for (; i + kRun <= n; i += kRun) {
    uint64_t x[4], y[4];
    memcpy(x, b + i, 32);
    memcpy(y, t + i, 32);
    if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
    uint32_t m = 0;
    for (uint32_t j = 0; j < kRun; ++j) m |= static_cast<uint32_t>(b[i + j] != t[i + j]) << j;
    for (; m; m &= m - 1) {
      const uint32_t j = i + static_cast<uint32_t>(__builtin_ctz(m));
      pos[c] = static_cast<uint16_t>(j), z[c++] = delta::delta_zigzag(b[j], t[j], w);
    }
  }
  for (; i < n; ++i)
    if (b[i] != t[i]) pos[c] = static_cast<uint16_t>(i), z[c++] = delta::delta_zigzag(b[i], t[i], w);
  return c;
}

// LSB-first bits into little-endian 32-bit words through a 64-bit
// accumulator: the bytes delta::put_rice ORs into zeroed words, a word
// stored once instead of read and rewritten per code.
struct BitSink {
  uint8_t* p;
  uint64_t acc = 0;
  int n = 0;
  PZ_FORCE_INLINE void put(uint32_t v, int bits) {  // v < 2^bits, bits <= 32
    acc |= static_cast<uint64_t>(v) << n;
    n += bits;
    if (n >= 32) fmt::put_u32(p, static_cast<uint32_t>(acc)), p += 4, acc >>= 32, n -= 32;
  }
  PZ_FORCE_INLINE void rice(uint32_t x, int k, int raw) {
    const uint32_t q = x >> k;
    if (q < delta::kEscapeOnes) {
      put((1u << q) - 1u, static_cast<int>(q) + 1);
      put(x & delta::low_mask(k), k);
    } else {
      put(delta::low_mask(delta::kEscapeOnes), delta::kEscapeOnes);
      put(x, raw);
    }
  }
  void flush() {
    if (n) fmt::put_u32(p, static_cast<uint32_t>(acc));
  }
};

// Codes one block, appending its payload to out; returns its table entry.
// pos and z: room for the block's elements.
template <class T>
Entry code_block(const T* b, const T* t, uint32_t n, int log2, int w, uint16_t* pos, uint32_t* z,
                 std::vector<uint8_t>* out) {
  const uint32_t c = collect(b, t, n, w, pos, z);
  Entry e{0, c, 0, 0};
  if (!c) return e;
  uint64_t sv = 0;
  for (uint32_t i = 0; i < c; ++i) sv += z[i] - 1u;
  e.k_gap = delta::choose_k(pos[c - 1] + 1u - c, c, log2);  // the gaps sum to last + 1 - count
  e.k_value = delta::choose_k(sv, c, w);
  uint64_t bits = 0;
  for (uint32_t i = 0, next = 0; i < c; next = pos[i] + 1u, ++i)
    bits += delta::element_bits(pos[i] - next, z[i], e, log2, w);
  e.bytes = static_cast<uint32_t>(4 * ((bits + 31) / 32));
  const size_t at = out->size();
  out->resize(at + e.bytes);
  BitSink sink{out->data() + at};
  for (uint32_t i = 0, next = 0; i < c; next = pos[i] + 1u, ++i) {
    sink.rice(pos[i] - next, e.k_gap, log2);
    sink.rice(z[i] - 1u, e.k_value, w);
  }
  sink.flush();
  return e;
}

// One pass over the data: each thread codes its run of blocks, in order, into
// its own buffer; the buffers, in thread order, are the payload (so the
// split must be cpu::parallel_for's: contiguous runs, ascending by thread).
// Transient memory: the buffers (up to twice the payload as they grow) and
// the stream.
template <class T>
uint8_t* encode(const T* base, const T* target, fmt::DType d, uint64_t numel, int threads, uint64_t* total) {
  const int log2 = delta::kBlockLog2, w = delta::width_bits(d);
  const uint64_t nb = delta::num_blocks(numel, log2);
  std::vector<Entry> entries(nb);
  const uint64_t nt = cpu::thread_count(nb, threads);
  std::vector<std::vector<uint8_t>> parts(nt);
  std::atomic<bool> no_memory{false};
  cpu::parallel_for(nb, threads, [&](int th, uint64_t lo, uint64_t hi) {
    try {  // an exception must not leave a worker thread (std::terminate): it becomes this call's error
      std::vector<uint16_t> pos(1u << log2);
      std::vector<uint32_t> z(1u << log2);
      for (uint64_t k = lo; k < hi && !no_memory.load(std::memory_order_relaxed); ++k)
        entries[k] = code_block(base + (k << log2), target + (k << log2), delta::block_elems(numel, log2, k), log2,
                                w, pos.data(), z.data(), &parts[th]);
    } catch (const std::bad_alloc&) {
      no_memory = true;
    }
  });
  if (no_memory) {
    set_last_error("delta encode: out of memory for the coded blocks", std::to_string(numel).c_str());
    return nullptr;
  }
  delta::Header h;
  h.dtype = d;
  h.numel = numel;
  h.total_bytes = delta::payload_begin(nb);
  for (uint64_t k = 0; k < nb; ++k) h.changed += entries[k].count;
  std::vector<uint64_t> at(nt + 1, h.total_bytes);
  for (uint64_t t = 0; t < nt; ++t) at[t + 1] = at[t] + parts[t].size();
  h.total_bytes = at[nt];
  h.payload_bytes = h.total_bytes - delta::payload_begin(nb);
  uint8_t* out = static_cast<uint8_t*>(malloc(h.total_bytes));
  if (!out) {
    set_last_error("delta encode: allocating the stream failed", std::to_string(h.total_bytes).c_str());
    return nullptr;
  }
  for (uint64_t k = 0; k < nb; ++k) delta::put_entry(out + delta::kHeaderBytes + delta::kEntryBytes * k, entries[k]);
  try {  // parallel_for's own allocations may throw: the stream must not leak
    cpu::parallel_for(nt, threads, [&](int, uint64_t lo, uint64_t hi) {
      for (uint64_t t = lo; t < hi; ++t)
        if (!parts[t].empty()) memcpy(out + at[t], parts[t].data(), parts[t].size());
    });
    const uint64_t nbytes = numel * sizeof(T);
    h.base_sum = checksum(reinterpret_cast<const uint8_t*>(base), nbytes, threads);
    h.target_sum = checksum(reinterpret_cast<const uint8_t*>(target), nbytes, threads);
    h.body_sum = delta::body_checksum(checksum(out + delta::kHeaderBytes, h.total_bytes - delta::kHeaderBytes, threads));
  } catch (...) {
    free(out);
    throw;
  }
  delta::write_header(h, out);
  *total = h.total_bytes;
  return out;
}

// Validates the table; fills the blocks' payload offsets.
delta::Error check_table(const uint8_t* s, const delta::Header& h, std::vector<uint64_t>* offsets) {
  const int log2 = h.block_log2, w = delta::width_bits(h.dtype);
  const uint64_t nb = delta::num_blocks(h.numel, log2);
  offsets->assign(nb + 1, delta::payload_begin(nb));
  uint64_t changed = 0;
  for (uint64_t k = 0; k < nb; ++k) {
    const Entry e = delta::get_entry(s + delta::kHeaderBytes + delta::kEntryBytes * k);
    if (!delta::entry_ok(e, delta::block_elems(h.numel, log2, k), log2, w)) return delta::Error::BadTable;
    (*offsets)[k + 1] = (*offsets)[k] + e.bytes;  // each at most max_block_bytes: no wrap
    changed += e.count;
  }
  if (changed != h.changed || (*offsets)[nb] != h.total_bytes) return delta::Error::BadTable;
  return delta::Error::Ok;
}

template <class T>
uint32_t apply(T* base, const uint8_t* s, const delta::Header& h, int threads) {
  std::vector<uint64_t> offsets;
  if (const delta::Error e = check_table(s, h, &offsets); e != delta::Error::Ok) return static_cast<uint32_t>(e);
  const int log2 = h.block_log2, w = delta::width_bits(h.dtype);
  const uint64_t nb = offsets.size() - 1;
  // Every block decodes (nothing written) before any element changes: a bad stream leaves the base as it was.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1 && checksum(reinterpret_cast<const uint8_t*>(base), h.numel * sizeof(T), threads) != h.base_sum)
      return static_cast<uint32_t>(delta::Error::BaseMismatch);
    std::atomic<bool> bad{false};
    cpu::parallel_for(nb, threads, [&](int, uint64_t lo, uint64_t hi) {
      for (uint64_t k = lo; k < hi && !bad.load(std::memory_order_relaxed); ++k) {
        const Entry e = delta::get_entry(s + delta::kHeaderBytes + delta::kEntryBytes * k);
        T* blk = base + (k << log2);
        const uint32_t n = delta::block_elems(h.numel, log2, k);
        const bool ok = pass == 0 ? delta::decode_block(s + offsets[k], e, n, log2, w, [](uint32_t, uint32_t) {})
                                  : delta::decode_block(s + offsets[k], e, n, log2, w, [&](uint32_t i, uint32_t z) {
                                      delta::apply_element(blk, i, z, w);
                                    });
        if (!ok) bad = true;
      }
    });
    if (bad) return static_cast<uint32_t>(delta::Error::BadBlock);
  }
  if (checksum(reinterpret_cast<const uint8_t*>(base), h.numel * sizeof(T), threads) != h.target_sum)
    return static_cast<uint32_t>(delta::Error::TargetMismatch);
  return 0;
}

}  // namespace

uint64_t cpu_delta_checksum(const uint8_t* p, uint64_t nbytes, int threads) { return checksum(p, nbytes, threads); }

uint8_t* cpu_delta_encode(const uint8_t* base, const uint8_t* target, fmt::DType d, uint64_t numel, int threads,
                          uint64_t* total) {
  try {  // memory running out anywhere (the tables, the threads' own) is this call's one error
    switch (delta::width_bits(d)) {
      case 8: return encode(base, target, d, numel, threads, total);
      case 16:
        return encode(reinterpret_cast<const uint16_t*>(base), reinterpret_cast<const uint16_t*>(target), d, numel,
                      threads, total);
      case 32:
        return encode(reinterpret_cast<const uint32_t*>(base), reinterpret_cast<const uint32_t*>(target), d, numel,
                      threads, total);
    }
  } catch (const std::bad_alloc&) {
    set_last_error("delta encode: out of memory", std::to_string(numel).c_str());
    return nullptr;
  }
  set_last_error("delta encode: dtype is not one deltas code", "");
  return nullptr;
}

uint32_t cpu_delta_apply(uint8_t* base, fmt::DType d, uint64_t numel, const uint8_t* stream, uint64_t len,
                         int threads) {
  delta::Header h;
  delta::Error e = delta::parse_header(stream, len, len, &h);
  if (e == delta::Error::Ok && (h.dtype != d || h.numel != numel)) e = delta::Error::Mismatch;
  if (e == delta::Error::Ok &&
      delta::body_checksum(checksum(stream + delta::kHeaderBytes, h.total_bytes - delta::kHeaderBytes, threads)) !=
          h.body_sum)
    e = delta::Error::BadBodyChecksum;
  if (e != delta::Error::Ok) return static_cast<uint32_t>(e);
  switch (delta::width_bits(d)) {
    case 8: return apply(base, stream, h, threads);
    case 16: return apply(reinterpret_cast<uint16_t*>(base), stream, h, threads);
    default: return apply(reinterpret_cast<uint32_t*>(base), stream, h, threads);
  }
}

}  // namespace pz
