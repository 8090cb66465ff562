// The pz backend's native gate: a c10d Backend that posts an op `auto` sends
// native straight to the Communicator's group, with no Python on the way, and
// hands every other op to the backend's Python path. Built against the
// installed torch (portable_zip/c10d/native.py), never part of the wheel.
//
// Python opens the gate after its own thin path ran an op native with nothing
// of pz's outstanding, and allows that op's signature (op, dtype, bytes). The
// gate then posts the same op itself while: it is open, the signature is
// allowed, the call is outside a backward pass (DDP's failures need Python's
// end-of-backward wait), the tensors are ones the thin path takes, and no
// op it posted and that has not finished touches the same storages. Python
// shuts it before anything of its own runs and takes the gate's posted ops
// into its order bookkeeping; a Communicator op also forgets the signatures
// (its plans may have changed).
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_set>

namespace py = pybind11;

namespace {

enum Op : int { kAllReduce = 0, kBroadcast = 1, kAllGather = 2, kOps = 3 };
const char* const kNames[kOps] = {"all_reduce", "broadcast", "all_gather"};

const void* storage(const at::Tensor& t) { return t.storage().data(); }

std::vector<const void*> storages(const std::vector<at::Tensor>& ts) {
  std::vector<const void*> out;
  for (const auto& t : ts) out.push_back(storage(t));
  return out;
}

// An op the gate knows is in flight: its storages as they were when it was
// posted (FSDP2 resizes storages), and its tensors, kept alive until it ends.
struct Posted {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> writes, reads;
  std::vector<const void*> wp, rp;
};

struct Counts {
  int64_t calls = 0, bytes = 0, ns = 0;
};

bool flat(const at::Tensor& t, c10::DeviceType kind) {
  return t.defined() && t.layout() == c10::kStrided && t.device().type() == kind && t.is_contiguous() &&
         !t.is_conj() && !t.is_neg();
}

bool touches(const std::vector<const void*>& a, const std::vector<const void*>& b) {
  for (const void* x : a)
    for (const void* y : b)
      if (x == y) return true;
  return false;
}

// Lets go of a Python object from any thread: torch may drop its group (and
// so these) without the GIL; past Python's end the object leaks.
void drop(py::object& o) {
  if (!o) return;
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    o = py::object();
  } else {
    o.release();
  }
}

// The Work of an op Python ran, as torch's C++ callers see it: every call
// goes to it (a Python subclass's overrides included), and it lives as long as this.
class Held : public c10d::Work {
 public:
  explicit Held(py::object w) : work_(w.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(w)) {}
  ~Held() override { drop(py_); }
  bool isCompleted() override {  // a Python Work's is_completed is Python's (torch's trampoline has no override)
    py::gil_scoped_acquire gil;
    return py_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override { return work_->exception(); }
  int sourceRank() const override { return work_->sourceRank(); }
  std::vector<at::Tensor> result() override { return work_->result(); }
  void synchronize() override { work_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  void abort() override { work_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object py_;
};

class Gate : public c10d::Backend {
 public:
  Gate(int rank, int size, const std::string& device) : Backend(rank, size), kind_(c10::Device(device).type()) {}

  ~Gate() override { drop(fallback_); }

  const std::string getBackendName() const override { return "pz"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    if (ts.size() == 1 && reduction(o.reduceOp) && flat(ts[0], kind_)) {
      auto w = post(kAllReduce, ts[0], ts, {}, 2 * ts[0].nbytes() * (size_ - 1) / size_,
                    [&](c10d::Backend& b) { return b.allreduce(ts, o); });
      if (w) return w;
    }
    return fallback("allreduce", ts, o);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    if (ts.size() == 1 && flat(ts[0], kind_)) {
      int64_t sent = o.rootRank == rank_ ? ts[0].nbytes() * (size_ - 1) : 0;
      auto w = post(kBroadcast, ts[0], ts, {}, sent, [&](c10d::Backend& b) { return b.broadcast(ts, o); });
      if (w) return w;
    }
    return fallback("broadcast", ts, o);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    // Apart, or in exactly out's slot of this rank (FSDP2's in-place all-gather).
    if (flat(out, kind_) && flat(in, kind_) && out.scalar_type() == in.scalar_type() &&
        out.numel() == size_ * in.numel() &&
        (storage(out) != storage(in) ||
         static_cast<const char*>(in.data_ptr()) == static_cast<const char*>(out.data_ptr()) + rank_ * in.nbytes())) {
      auto w = post(kAllGather, in, {out}, {in}, in.nbytes() * (size_ - 1),
                    [&](c10d::Backend& b) { return b._allgather_base(out, in, o); });
      if (w) return w;
    }
    return fallback("all_gather", out, in, o);
  }

  // --- the rest: torch's C++ callers (and _get_backend's) reach the inner backend, as before the gate ---
#define PZ_FORWARD(name, params, args)                     \
  c10::intrusive_ptr<c10d::Work> name params override {    \
    return base(#name).name args;                           \
  }
  PZ_FORWARD(allreduce_coalesced, (std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o), (t, o))
  PZ_FORWARD(reduce, (std::vector<at::Tensor>& t, const c10d::ReduceOptions& o), (t, o))
  PZ_FORWARD(allgather, (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                         const c10d::AllgatherOptions& o), (out, in, o))
  PZ_FORWARD(allgather_coalesced, (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                   const c10d::AllgatherOptions& o), (out, in, o))
  PZ_FORWARD(allgather_into_tensor_coalesced, (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                               const c10d::AllgatherOptions& o), (out, in, o))
  PZ_FORWARD(gather, (std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                      const c10d::GatherOptions& o), (out, in, o))
  PZ_FORWARD(scatter, (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                       const c10d::ScatterOptions& o), (out, in, o))
  PZ_FORWARD(reduce_scatter, (std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                              const c10d::ReduceScatterOptions& o), (out, in, o))
  PZ_FORWARD(_reduce_scatter_base, (at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o),
             (out, in, o))
  PZ_FORWARD(reduce_scatter_tensor_coalesced, (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                               const c10d::ReduceScatterOptions& o), (out, in, o))
  PZ_FORWARD(alltoall_base, (at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os, std::vector<int64_t>& is,
                             const c10d::AllToAllOptions& o), (out, in, os, is, o))
  PZ_FORWARD(alltoall, (std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o),
             (out, in, o))
  PZ_FORWARD(send, (std::vector<at::Tensor>& t, int dst, int tag), (t, dst, tag))
  PZ_FORWARD(recv, (std::vector<at::Tensor>& t, int src, int tag), (t, src, tag))
  PZ_FORWARD(recvAnysource, (std::vector<at::Tensor>& t, int tag), (t, tag))
  PZ_FORWARD(barrier, (const c10d::BarrierOptions& o), (o))
#undef PZ_FORWARD
  void monitoredBarrier(const c10d::BarrierOptions& o, bool waitAll) override {
    base("monitoredBarrier").monitoredBarrier(o, waitAll);
  }
  void setSequenceNumberForGroup() override {
    if (base_) base_->setSequenceNumberForGroup();
  }
  uint64_t getSequenceNumberForGroup() override { return base_ ? base_->getSequenceNumberForGroup() : 0; }

  // --- what Python calls ----------------------------------------------------
  void set_base(c10::intrusive_ptr<c10d::Backend> b) { base_ = std::move(b); }
  void set_inner(c10::intrusive_ptr<c10d::Backend> inner) {
    std::lock_guard<std::mutex> lk(m_);
    inner_ = std::move(inner);
  }
  void set_fallback(py::object fb) { fallback_ = std::move(fb); }
  void open() {
    std::lock_guard<std::mutex> lk(m_);
    open_ = inner_.defined();
  }
  void forget() {
    std::lock_guard<std::mutex> lk(m_);
    open_ = false;
    allowed_.clear();
  }
  void allow(int op, const at::Tensor& t) {
    std::lock_guard<std::mutex> lk(m_);
    if (allowed_.size() > 4096) allowed_.clear();
    allowed_.insert(key(op, t));
  }
  void track(c10::intrusive_ptr<c10d::Work> w, std::vector<at::Tensor> writes, std::vector<at::Tensor> reads) {
    auto wp = storages(writes), rp = storages(reads);
    std::lock_guard<std::mutex> lk(m_);
    posted_.push_back({std::move(w), std::move(writes), std::move(reads), std::move(wp), std::move(rp)});
  }
  // Shut, and hand over the ops posted and not yet known finished, in order.
  std::vector<Posted> take() {
    std::lock_guard<std::mutex> lk(m_);
    open_ = false;
    std::vector<Posted> out(std::make_move_iterator(posted_.begin()), std::make_move_iterator(posted_.end()));
    posted_.clear();
    return out;
  }
  // Per op: calls, bytes sent, ns spent posting, since the last call.
  py::dict counts() {
    Counts c[kOps];
    {
      py::gil_scoped_release nogil;  // never wait on the lock holding the GIL
      std::lock_guard<std::mutex> lk(m_);
      std::copy(counts_, counts_ + kOps, c);
      std::fill(counts_, counts_ + kOps, Counts{});
    }
    py::dict d;
    for (int i = 0; i < kOps; ++i)
      if (c[i].calls) d[kNames[i]] = py::make_tuple(c[i].calls, c[i].bytes, c[i].ns);
    return d;
  }
  void release() {  // at shutdown: no fallback holds the Python backend, no posted op keeps its tensors
    std::deque<Posted> gone;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(m_);
      open_ = false;
      allowed_.clear();
      gone.swap(posted_);
      inner_.reset();
    }
    base_.reset();  // the inner backends' threads and sockets go with their groups, not with torch's
    fallback_ = py::object();
  }
  int64_t posted() {  // ops the gate posted itself, since it was made
    std::lock_guard<std::mutex> lk(m_);
    return posted_total_;
  }

 private:
  static bool reduction(const c10d::ReduceOp& r) {
    return r.op_ == c10d::ReduceOp::SUM || r.op_ == c10d::ReduceOp::AVG || r.op_ == c10d::ReduceOp::MIN ||
           r.op_ == c10d::ReduceOp::MAX;
  }
  static int64_t key(int op, const at::Tensor& t) {
    // bytes < 2^52 for any tensor a host holds; dtype < 2^8; op < 2^4
    return (static_cast<int64_t>(t.nbytes()) << 12) | (static_cast<int64_t>(t.scalar_type()) << 4) | op;
  }

  template <class F>
  c10::intrusive_ptr<c10d::Work> post(int op, const at::Tensor& t, std::vector<at::Tensor> writes,
                                      std::vector<at::Tensor> reads, int64_t sent, F&& start) {
    if (torch::autograd::get_current_graph_task_id() != -1) return {};
    // Never wait on the gate's lock holding the GIL: Python takes the lock under it.
    std::optional<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil.emplace();
    auto wp = storages(writes), rp = storages(reads);
    std::vector<Posted> gone;  // finished ops leave after the lock: their tensors may take the GIL as they go
    std::lock_guard<std::mutex> lk(m_);
    if (!open_ || !allowed_.count(key(op, t))) return {};
    while (!posted_.empty() && posted_.front().work->isCompleted()) {
      gone.push_back(std::move(posted_.front()));
      posted_.pop_front();
    }
    for (const auto& p : posted_)  // two ops on one tensor never run out of order: Python settles those
      if (touches(wp, p.wp) || touches(wp, p.rp) || touches(rp, p.wp)) return {};
    auto t0 = std::chrono::steady_clock::now();
    auto w = start(*inner_);
    auto& c = counts_[op];
    ++posted_total_;
    ++c.calls;
    c.bytes += sent;
    c.ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    if (posted_.size() >= 64)  // works mostly finish in order; past this, every finished one leaves
      for (auto it = posted_.begin(); it != posted_.end();) {
        if ((*it).work->isCompleted()) {
          gone.push_back(std::move(*it));
          it = posted_.erase(it);
        } else {
          ++it;
        }
      }
    posted_.push_back({w, std::move(writes), std::move(reads), std::move(wp), std::move(rp)});
    return w;
  }

  template <class... A>
  c10::intrusive_ptr<c10d::Work> fallback(const char* name, A&... args) {
    py::gil_scoped_acquire gil;
    if (!fallback_) throw std::runtime_error("pz backend: this group is shut down");
    py::object w = fallback_(name, args...);
    return c10::make_intrusive<Held>(std::move(w));
  }

  c10d::Backend& base(const char* op) {
    if (!base_) throw std::runtime_error(std::string("pz backend: ") + op + " has no inner backend on this device");
    return *base_;
  }

  const c10::DeviceType kind_;
  c10::intrusive_ptr<c10d::Backend> base_;
  std::mutex m_;
  bool open_ = false;
  c10::intrusive_ptr<c10d::Backend> inner_;
  std::unordered_set<int64_t> allowed_;
  std::deque<Posted> posted_;
  Counts counts_[kOps];
  int64_t posted_total_ = 0;
  py::object fallback_;  // fallback(name, *args): ProcessGroupPZ's Python method _py_<name>
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::object backend = py::module_::import("torch._C._distributed_c10d").attr("Backend");
  py::class_<Gate, c10::intrusive_ptr<Gate>>(m, "Gate", backend)
      .def(py::init<int, int, const std::string&>())
      .def("set_inner", &Gate::set_inner, py::call_guard<py::gil_scoped_release>())
      .def("set_base", &Gate::set_base)
      .def("set_fallback", &Gate::set_fallback)
      .def("open", &Gate::open, py::call_guard<py::gil_scoped_release>())
      .def("forget", &Gate::forget, py::call_guard<py::gil_scoped_release>())
      .def("allow", &Gate::allow, py::call_guard<py::gil_scoped_release>())
      .def("track", &Gate::track, py::call_guard<py::gil_scoped_release>())
      .def("posted", &Gate::posted, py::call_guard<py::gil_scoped_release>())
      .def("take",
           [](Gate& g) {
             std::vector<Posted> ps;
             {
               py::gil_scoped_release nogil;
               ps = g.take();
             }
             py::list out;
             for (auto& p : ps) out.append(py::make_tuple(p.work, p.writes, p.reads));
             return out;
           })
      .def("counts", &Gate::counts)
      .def("release", &Gate::release);
}
