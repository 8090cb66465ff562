#include "engine.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include <netinet/in.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "fabric_lib.h"
#include <arpa/inet.h>

#include "iface.h"  // PZ_FABRIC_IFACE
#include "keyed.h"  // tags keyed by the group's secret
#include "portable_zip/format.h"       // a sized message's length: the stream's own
#include "portable_zip/gpu_runtime.h"  // staging copies of GPU memory

namespace pz::fabric {
namespace {

constexpr uint64_t kMinChunk = 64 << 10;
constexpr uint32_t kMaxChunks = 1u << 24;  // chunk index bits of a tag
constexpr char kAddrMagic[4] = {'P', 'Z', 'F', '3'};  // 3: push with credits (2: each direction on rails of its own)
constexpr size_t kAddrTail = 12;  // after the rails' names: the push window in chunks (4), rxm's eager limit (8)
constexpr size_t kProvField = 32;

// The plain tag: source rank (16 bits) | message sequence of the pair (24) |
// chunk (24). Both ends count a pair's messages in posting order, so tags
// match without a round trip, and the source rank keeps receives apart where
// the provider cannot direct them. On the wire it is permuted under the
// group's secret with the receiver as tweak: a bijection, so one receiver's
// tags stay distinct, while a process without the secret hits a posted
// receive with probability (receives posted) / 2^64.
uint64_t wire_tag(const Config& cfg, int src, int dst, uint32_t seq, uint32_t idx) {
  const uint64_t plain = (static_cast<uint64_t>(src & 0xFFFF) << 48) |
                         (static_cast<uint64_t>(seq & 0xFFFFFF) << 24) | (idx & 0xFFFFFF);
  return keyed::permute64(reinterpret_cast<const uint8_t*>(cfg.secret.data()), static_cast<uint32_t>(dst), plain);
}

// Providers whose endpoint names are IP socket addresses, so a node address
// with FI_SOURCE picks the interface they listen on (shm is host-local; efa
// names a device, not an address).
bool ip_named(const std::string& prov) {
  return prov.find("tcp") != std::string::npos || prov.find("sockets") != std::string::npos ||
         prov.find("verbs") != std::string::npos || prov.find("udp") != std::string::npos;
}

// A deadline d from now for condition_variable::wait_until, on system_clock:
// libstdc++ waits for a steady_clock time with pthread_cond_clockwait (glibc
// 2.30), for a system_clock time with pthread_cond_timedwait (manylinux_2_28).
template <class D>
auto after(D d) {
  return std::chrono::system_clock::now() + d;
}

// A sized message's length, the total of the stream it carries: the
// format's answer from the first `avail` bytes (the transport reads no header
// field itself). False unless it is at least a fixed header (no stream is
// shorter) and at most `room`.
bool sized_total(const uint8_t* head, uint64_t avail, uint64_t room, uint64_t* total) {
  *total = 0;
  return fmt::stream_total_bytes(head, avail, total) && *total >= fmt::kFixedHeaderBytes && *total <= room;
}

// Why the wire stopped when rxm tore a connection down (fabric_lib.h, conn_closes_here).
constexpr char kConnClosed[] =
    "a peer's connection closed (the peer exited or died; libfabric tore the connection down)";

void check(int rc, const char* what) {
  if (rc) throw std::runtime_error(std::string("libfabric: ") + what + " failed: " + err_text(rc));
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A torn connection is a peer's (it died or closed) or a stranger's (a
// process that spoke rxm to our endpoint and left). Without a watch: a
// peer's, the wire stops. With one: posts wait kSettleNs after the first
// unsettled tear (a receive posted now could match the torn connection's
// stale requests), then ask the watch's sockets whether any peer has gone:
// a dying peer's kernel closes its fabric and watch sockets together, so
// by then its hangup is on the watch's socket too. None: the tears were
// strangers', and posts go on (a flood of strangers costs each post at
// most kSettleNs, not the job). One: the wire stops. A peer that closed
// quietly (its goodbye says every transfer it posted had completed, so no
// rendezvous request of its own is stale) explains the tear of each
// connection to it that carried traffic (rails_used_) and stops nothing:
// its eager sends that we have not
// matched yet are still delivered (send, then close, is a correct
// program), and a wait on it that nothing answers fails at the watch's
// grace. That holds where an unmatched eager message keeps no pointer to
// its connection: rxm over tcp with dynamic receive buffers (1.17's
// default there, which turns segmented messages off). Elsewhere (verbs'
// segmented messages keep one) a quiet goodbye counts as a death's. A
// death the watch names within kStrangerNs of a tear stops the wire too,
// whatever quiet goodbyes explained meanwhile.
constexpr int64_t kSettleNs = 2'000'000;
constexpr int64_t kStrangerNs = 3'000'000'000;

// An rxm switch that is on unless the user turned it off.
bool rxm_on(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return true;
  std::string s(v);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(s == "0" || s == "false" || s == "no" || s == "off" || s == "n" || s == "f");
}

// rxm's dynamic receive buffers (FI_OFI_RXM_ENABLE_DYN_RBUF, on by default over tcp).
bool rxm_dynamic_rbuf() { return rxm_on("FI_OFI_RXM_ENABLE_DYN_RBUF"); }

// The eager limit rxm 1.17 gives an endpoint opened now (rxm_ep_init_proto):
// its bounce-buffer size, raised to FI_OFI_RXM_EAGER_LIMIT only with
// dynamic receive buffers and direct send (both on by default over tcp).
// rxm refuses a connection between endpoints whose limits differ.
uint64_t rxm_eager_limit() {
  auto num = [](const char* name, uint64_t dflt) -> uint64_t {
    const char* v = std::getenv(name);
    return v ? std::strtoull(v, nullptr, 10) : dflt;
  };
  const uint64_t buf = num("FI_OFI_RXM_BUFFER_SIZE", 16384);
  if (!rxm_dynamic_rbuf() || !rxm_on("FI_OFI_RXM_ENABLE_DIRECT_SEND")) return buf;
  return std::max(buf, num("FI_OFI_RXM_EAGER_LIMIT", buf));
}

}  // namespace

struct Xfer {
  Op op;
  uint64_t batch = 0;
  size_t index = 0;      // the op's place in its batch
  uint32_t seq = 0;
  bool staged = false;
  uint64_t total = 0;    // bytes to move (sized kinds: known after chunk 0)
  uint32_t nchunks = 0;  // 0 with a sized kind until chunk 0 says
  uint32_t next = 0, done = 0;
  bool queued = true;     // still in its pair's FIFO (posting chunks)
  bool finished = false;  // every chunk done and reported
  bool send() const { return op.kind == Kind::Send || op.kind == Kind::SendSized; }
  bool sized() const { return op.kind == Kind::SendSized || op.kind == Kind::RecvSized; }
};

struct Chunk {
  fi_context2 ctx;  // first: libfabric returns its address as op_context
  Xfer* x = nullptr;     // nullptr: a credit receive (push), into `credit`
  uint64_t credit = 0;
  Pair* pair = nullptr;
  uint32_t idx = 0;
  int slot = -1;
  int rail = 0;
  uint64_t off = 0, len = 0;
  enum State { CopyOut, Wire, CopyIn } state = Wire;
  bool copy_done = false;  // host staging copies finish at once
};

// Per peer: FIFO queues of transfers still posting chunks (sends, receives),
// chunks in flight per direction, and the staging ring (depth slots each way).
struct Pair {
  int peer = 0;
  std::deque<Xfer*> q[2];
  int inflight[2] = {0, 0};
  std::vector<int> free_slots[2];
  uint8_t* slab = nullptr;
  bool pinned = false;
  std::vector<fid_mr*> mrs;  // the ring's registration in each rail's domain (FI_MR_LOCAL providers)
  std::vector<void*> events;
  std::vector<Chunk*> retry;  // posts the provider refused with FI_EAGAIN
  // Push (engine.h, Config::window), in chunks. Sender: chunks started to
  // the peer, credits received (each a quarter window it consumed), one
  // credit receive posted while the next is due. Receiver: chunks that
  // arrived from the peer, credits sent for them.
  uint64_t sent = 0, credits = 0;
  bool credit_posted = false;
  uint64_t consumed = 0, credited = 0;
};

std::string probe() { return load_error(); }

std::string bind_address(const std::string& iface, bool same_host) {
  std::string ip;
  in_addr numeric{};
  if (inet_pton(AF_INET, iface.c_str(), &numeric) == 1) {  // the Python side's choice (comm/address.py)
    ip = iface;
  } else if (!iface.empty()) {  // checked even on one host, where loopback wins: a typo shows at once
    sockaddr_storage sa;
    socklen_t len;
    net::iface_address(iface, false, &sa, &len);  // IPv4: the engine names its endpoint by a dotted address
    ip = net::numeric_host(sa);
  }
  return same_host ? "127.0.0.1" : ip;
}

Engine::Engine(const Config& cfg) : want_(cfg), cfg_(cfg) {
  if (want_.rails && (want_.rails < 1 || want_.rails > 16)) throw std::invalid_argument("PZ_FABRIC_RAILS must be 1 to 16");
  if (want_.chunk && (want_.chunk < kMinChunk || want_.chunk > (1ull << 30)))
    throw std::invalid_argument("PZ_FABRIC_CHUNK must be 64 KiB to 1 GiB");
  want_.chunk = (want_.chunk + 4095) & ~uint64_t{4095};  // whole pages: slots stay aligned
  if (want_.depth && (want_.depth < 1 || want_.depth > 64)) throw std::invalid_argument("PZ_FABRIC_DEPTH must be 1 to 64");
  if (want_.window < -1 || want_.window > (int64_t{1} << 40))
    throw std::invalid_argument("PZ_FABRIC_WINDOW must be 0 (off) to 1 TiB");
  if (cfg_.world > 0xFFFF) throw std::invalid_argument("the fabric transport supports up to 65535 ranks");
  rails_used_ = std::make_unique<std::atomic<uint32_t>[]>(static_cast<size_t>(std::max(cfg_.world, 1)));  // zeroed
  gone_peer_ = std::make_unique<std::atomic<uint8_t>[]>(static_cast<size_t>(std::max(cfg_.world, 1)));
  lib();  // throws with the library's install hint
  open_provider();
  send_seq_.assign(cfg_.world, 0);
  recv_seq_.assign(cfg_.world, 0);
  if (cfg_.device >= 0) {
    if (gpu_set_device(cfg_.device) || gpu_stream_new(&copy_stream_) || gpu_event_new(&order_event_)) {
      const std::string why = last_error_message();
      teardown();
      throw std::runtime_error("fabric staging: " + why);
    }
  }
}

Engine::~Engine() { close(); }

void Engine::open_provider() {
  if (cfg_.secret.size() != 16)
    throw std::invalid_argument("fabric: the group's secret must be 16 bytes, got " + std::to_string(cfg_.secret.size()));
  bind_ip_ = bind_address(cfg_.iface, cfg_.same_host);
  const Lib& L = lib();
  const uint32_t v = L.version();
  const uint32_t api = FI_VERSION(FI_MAJOR(v), std::min<uint32_t>(FI_MINOR(v), 18));
  std::vector<std::string> order;
  if (!cfg_.provider.empty()) {
    order.push_back(cfg_.provider);
  } else {
    if (cfg_.same_host) order.push_back("shm");
    order.insert(order.end(), {"efa", "verbs;ofi_rxm"});
    if (FI_MINOR(v) >= 18) order.push_back("tcp");  // xnet: RDM natively
    order.push_back("tcp;ofi_rxm");
  }
  auto query = [&](const std::string& prov, bool hmem, fi_info** out, fi_threading threading, bool directed) {
    fi_info* hints = L.dupinfo(nullptr);
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | FI_MSG | (hmem ? FI_HMEM : 0) | (directed ? FI_DIRECTED_RECV : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  (hmem ? FI_MR_HMEM : 0);
    hints->domain_attr->threading = threading;
    hints->fabric_attr->prov_name = strdup(prov.c_str());
    const bool bind = !bind_ip_.empty() && ip_named(prov);  // listen on that address only
    const int rc = L.getinfo(api, bind ? bind_ip_.c_str() : nullptr, nullptr, bind ? FI_SOURCE : 0, hints, out);
    L.freeinfo(hints);
    return rc;
  };
  std::string tried;
  for (const auto& prov : order) {
    resolve(prov);
    // FI_THREAD_SAFE: each rail's pump thread reads its completion queue (where
    // tcp moves the bytes) while the progress thread posts. Else one thread does all.
    // FI_DIRECTED_RECV: a receive matches only its peer's address; without it, tags alone.
    fi_info* got = nullptr;
    int rc = -FI_ENODATA;
    for (bool directed : {true, false}) {
      rc = cfg_.rails > 1 ? query(prov, false, &got, FI_THREAD_SAFE, directed) : -FI_ENODATA;
      threads_safe_ = rc == 0 && got;
      if (!threads_safe_) rc = query(prov, false, &got, FI_THREAD_DOMAIN, directed);
      directed_ = directed;
      if (rc == 0 && got) break;
    }
    if (rc != 0 || !got) {
      tried += "\n  " + prov + ": " + err_text(rc);
      continue;
    }
    info_ = L.dupinfo(got);  // the first match only
    trust_quiet_ = prov == "tcp;ofi_rxm" && rxm_dynamic_rbuf();
    L.freeinfo(got);
    // Credits land in unregistered memory: a provider that wants it
    // registered gets the defaults without push.
    if (push_ && (info_->domain_attr->mr_mode & FI_MR_LOCAL)) resolve(prov, false);
    fi_info* h = nullptr;
    hmem_ = query(prov, true, &h, FI_THREAD_DOMAIN, directed_) == 0 && h;
    if (h) L.freeinfo(h);
    // rxm reads its eager limit as each endpoint opens and sizes no buffer
    // by it (1.17's bounce buffers follow FI_OFI_RXM_BUFFER_SIZE). Ours,
    // unless the user set one: 1 MiB, so chunks up to that travel eagerly,
    // set only while our endpoints open (a later engine without push keeps
    // rxm's default). The limit travels in our address: ranks that differ
    // are told so at connect, not refused by rxm in silence.
    // One engine at a time between set and unset (process groups may be made on several threads).
    static std::mutex env_mu;
    std::unique_lock<std::mutex> env_lock(env_mu);
    const bool ours = push_ && !std::getenv("FI_OFI_RXM_EAGER_LIMIT");
    if (ours) setenv("FI_OFI_RXM_EAGER_LIMIT", "1048576", 0);
    eager_limit_ = prov == "tcp;ofi_rxm" ? rxm_eager_limit() : 0;
    try {
      open_endpoints();
      if (ours) unsetenv("FI_OFI_RXM_EAGER_LIMIT");
      break;
    } catch (const std::exception& e) {  // listed but unusable here (shm without CMA rights): the next one
      if (ours) unsetenv("FI_OFI_RXM_EAGER_LIMIT");
      tried += "\n  " + prov + ": " + e.what();
      close_endpoints();
    }
  }
  if (!info_) {
    std::string avail;
    fi_info* all = nullptr;
    fi_info* hints = L.dupinfo(nullptr);
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED;
    if (L.getinfo(api, nullptr, nullptr, 0, hints, &all) == 0) {
      for (fi_info* i = all; i; i = i->next)
        if (avail.find(i->fabric_attr->prov_name) == std::string::npos)
          avail += std::string(avail.empty() ? "" : ", ") + i->fabric_attr->prov_name;
      L.freeinfo(all);
    }
    L.freeinfo(hints);
    throw std::runtime_error("no usable libfabric provider (reliable datagram, tagged messages) in " + L.path +
                             ":" + tried + "\nproviders this host offers: " + (avail.empty() ? "none" : avail) +
                             (cfg_.provider.empty() ? "" : "\n(PZ_FABRIC_PROVIDER forces the first)"));
  }
}

// The settings for provider prov: what was asked, else its defaults. Push
// (every chunk eager, a window of credits) where rxm's eager limit is ours to
// set and the read request of a rendezvous would queue behind the
// receiver's own bulk data on a link that binds (bench/NOTES.md, seventh
// and ninth sessions): tcp;ofi_rxm.
void Engine::resolve(const std::string& prov, bool may_push) {
  // rxm sends our chunks eagerly only with dynamic receive buffers and direct send.
  push_ = may_push && want_.window != 0 && prov == "tcp;ofi_rxm" && rxm_dynamic_rbuf() &&
          rxm_on("FI_OFI_RXM_ENABLE_DIRECT_SEND");
  cfg_.rails = want_.rails ? want_.rails : push_ ? 1 : 2;
  cfg_.chunk = want_.chunk ? want_.chunk : push_ ? (256u << 10) : (2u << 20);
  cfg_.depth = want_.depth ? want_.depth : std::max(4, 2 * cfg_.rails);
  const uint64_t bytes = want_.window > 0 ? static_cast<uint64_t>(want_.window) : (4u << 20);
  win_ = push_ ? static_cast<uint32_t>(std::min<uint64_t>(std::max<uint64_t>(4, bytes / cfg_.chunk), 1u << 20)) & ~3u : 0;
  quarter_ = win_ / 4;
  eager_limit_ = 0;
}

void Engine::open_endpoints() {
  mr_local_ = info_->domain_attr->mr_mode & FI_MR_LOCAL;
  check(lib().open_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
  rails_.assign(cfg_.rails, Rail{});
  for (auto& r : rails_) {  // a domain per rail: rails share no provider lock or progress
    check(fi_domain(fabric_, info_, &r.domain, nullptr), "fi_domain");
    fi_cq_attr cq{};
    cq.format = FI_CQ_FORMAT_TAGGED;
    check(fi_cq_open(r.domain, &cq, &r.cq, nullptr), "fi_cq_open");
    fi_av_attr av{};
    av.type = FI_AV_TABLE;
    check(fi_av_open(r.domain, &av, &r.av, nullptr), "fi_av_open");
    check(fi_endpoint(r.domain, info_, &r.ep, nullptr), "fi_endpoint");
    check(fi_ep_bind(r.ep, &r.av->fid, 0), "binding the address vector");
    check(fi_ep_bind(r.ep, &r.cq->fid, FI_TRANSMIT | FI_RECV), "binding the completion queue");
    check(fi_enable(r.ep), "fi_enable");
    size_t len = 0;
    fi_getname(&r.ep->fid, nullptr, &len);  // -FI_ETOOSMALL, with the length
    r.name.resize(len);
    check(fi_getname(&r.ep->fid, r.name.data(), &len), "fi_getname");
    r.name.resize(len);
  }
  char text[256];  // the first rail's name as the provider writes it (where it listens)
  size_t tlen = sizeof text;
  endpoint_ = fi_av_straddr(rails_[0].av, rails_[0].name.data(), text, &tlen) ? std::string(text) : "";
}

// Endpoints first: closing them cancels every posted operation, so the
// provider never writes into a user's buffer after a failed wait returns.
void Engine::close_endpoints() {
  for (auto& r : rails_) {
    if (r.ep) fi_close(&r.ep->fid);
    if (r.av) fi_close(&r.av->fid);
    if (r.cq) fi_close(&r.cq->fid);
    if (r.domain) fi_close(&r.domain->fid);
    r = Rail{};
  }
  rails_.clear();
  if (fabric_) fi_close(&fabric_->fid);
  fabric_ = nullptr;
  if (info_) lib().freeinfo(info_);
  info_ = nullptr;
}

std::string Engine::address() const {
  std::string a(kAddrMagic, 4);
  std::string prov(info_->fabric_attr->prov_name);
  prov.resize(kProvField, '\0');
  a += prov;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) a.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  };
  put(cfg_.rails, 4);
  put(cfg_.chunk, 8);
  put(cfg_.depth, 4);
  put(rails_[0].name.size(), 4);
  for (const auto& r : rails_) a += r.name;
  put(win_, 4);
  put(eager_limit_, 8);
  return a;
}

void Engine::connect(const std::vector<std::string>& addrs) {
  if (connected_) throw std::logic_error("connect: already connected");
  if (static_cast<int>(addrs.size()) != cfg_.world) throw std::invalid_argument("connect: one address per rank");
  const std::string mine = address();
  const size_t fixed = 4 + kProvField + 20;
  for (int j = 0; j < cfg_.world; ++j) {
    const std::string& a = addrs[j];
    if (a.size() >= 4 && a.compare(0, 3, kAddrMagic, 3) == 0 && a[3] != kAddrMagic[3])
      throw std::invalid_argument("rank " + std::to_string(j) + " runs fabric wire version " + a[3] + ", rank " +
                                  std::to_string(cfg_.rank) + " version " + kAddrMagic[3] +
                                  ": run one portable_zip version on every rank");
    if (a.size() < fixed || a.compare(0, 4, kAddrMagic, 4) != 0)
      throw std::runtime_error("rank " + std::to_string(j) + " sent a garbled fabric address");
    if (a.compare(0, fixed, mine, 0, fixed) != 0) {
      auto prov = [](const std::string& s) { return std::string(s.c_str() + 4); };
      throw std::invalid_argument("fabric settings differ: rank " + std::to_string(j) + " uses provider '" + prov(a) +
                                  "' with its rails/chunk/depth, rank " + std::to_string(cfg_.rank) + " '" +
                                  prov(mine) + "' (set PZ_FABRIC_PROVIDER, PZ_FABRIC_RAILS, PZ_FABRIC_CHUNK, "
                                  "PZ_FABRIC_DEPTH and PZ_FABRIC_WINDOW alike on every rank)");
    }
    if (a.size() != mine.size()) throw std::runtime_error("rank " + std::to_string(j) + " sent a truncated address");
    if (a.compare(a.size() - kAddrTail, kAddrTail, mine, mine.size() - kAddrTail, kAddrTail) != 0)
      throw std::invalid_argument("fabric push settings differ between rank " + std::to_string(j) + " and rank " +
                                  std::to_string(cfg_.rank) +
                                  " (set PZ_FABRIC_WINDOW and the FI_OFI_RXM_* variables alike on every rank)");
  }
  const size_t nlen = rails_[0].name.size();
  for (int r = 0; r < cfg_.rails; ++r) {
    std::string names;
    for (const auto& a : addrs) names += a.substr(fixed + r * nlen, nlen);
    rails_[r].addr.assign(cfg_.world, FI_ADDR_NOTAVAIL);
    const int n = fi_av_insert(rails_[r].av, names.data(), cfg_.world,
                               reinterpret_cast<fi_addr_t*>(rails_[r].addr.data()), 0, nullptr);
    if (n != cfg_.world) throw std::runtime_error("libfabric: fi_av_insert took " + std::to_string(n) + " of " +
                                                  std::to_string(cfg_.world) + " addresses");
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    connected_ = true;
  }
  // From here on only our threads call into libfabric: the progress thread,
  // and with FI_THREAD_SAFE one pump per rail reading its completion queue.
  if (threads_safe_)
    for (int r = 0; r < cfg_.rails; ++r) pumps_.emplace_back([this, r] { pump(r); });
  thread_ = std::thread([this] { run(); });
}

uint64_t Engine::post(const std::vector<Op>& ops, void* user_stream) {
  std::vector<Xfer*> xs;
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!error_.empty()) throw std::runtime_error("the fabric transport failed earlier: " + error_);
    if (closed_ || !connected_) throw std::runtime_error("the fabric transport is closed");
    for (const Op& op : ops) {  // all checked before any takes a sequence number
      if (op.peer < 0 || op.peer >= cfg_.world || op.peer == cfg_.rank)
        throw std::invalid_argument("fabric: peer " + std::to_string(op.peer) + " is not another rank");
      if ((op.len + cfg_.chunk - 1) / cfg_.chunk >= kMaxChunks) throw std::invalid_argument("fabric: transfer too large for its chunk size");
      if ((op.kind == Kind::SendSized || op.kind == Kind::RecvSized) && op.len < fmt::kFixedHeaderBytes)
        throw std::invalid_argument("fabric: a sized transfer needs a buffer of at least a stream header (" +
                                    std::to_string(fmt::kFixedHeaderBytes) + " bytes), got " +
                                    std::to_string(op.len));
    }
    id = next_batch_++;
    Batch& b = batches_[id];
    b.lens.assign(ops.size(), 0);
    bool device = false;
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      if (op.len == 0) continue;  // both ends skip empty transfers alike
      auto* x = new Xfer;
      x->op = op;
      x->batch = id;
      x->index = i;
      x->staged = op.device || cfg_.stage_host || mr_local_;
      x->seq = x->send() ? send_seq_[op.peer]++ : recv_seq_[op.peer]++;
      if (!x->sized()) {
        x->total = op.len;
        x->nchunks = static_cast<uint32_t>((op.len + cfg_.chunk - 1) / cfg_.chunk);
      }
      device |= op.device;
      xs.push_back(x);
    }
    b.left = static_cast<int>(xs.size());
    // Staging copies run on our stream, after the caller's queued work: the
    // compress that fills a send, and any kernel still reading a receive buffer.
    if (device && gpu_stream_after(copy_stream_, user_stream, order_event_)) {
      for (auto* x : xs) delete x;
      batches_.erase(id);
      throw std::runtime_error(std::string("fabric staging: ") + last_error_message());
    }
    for (auto* x : xs) incoming_.push_back(x);
  }
  work_cv_.notify_one();
  return id;
}

int Engine::wait(uint64_t batch, double timeout_s, std::vector<uint64_t>* lens) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto deadline = after(std::chrono::duration<double>(timeout_s));
  auto it = batches_.find(batch);
  if (it == batches_.end()) throw std::invalid_argument("fabric: unknown batch");
  bool in_time = done_cv_.wait_until(lk, deadline, [&] { return it->second.left == 0 || closed_; });
  if (it->second.left == 0) {
    if (lens) *lens = it->second.lens;
    batches_.erase(it);
    return 0;
  }
  if (!in_time && error_.empty()) error_ = "a transfer timed out after " + std::to_string(timeout_s) + " s";
  if (!error_.empty()) stop_wire(error_);
  work_cv_.notify_all();
  // The progress thread tears the endpoints down (no late write into user memory), then signals.
  done_cv_.wait_until(lk, after(std::chrono::seconds(10)), [&] { return closed_; });
  batches_.erase(batch);
  if (!in_time) return 1;
  throw std::runtime_error(error_.empty() ? "the fabric transport was closed" : error_);
}

// Safe from any thread, while run(), post(), wait() or close() run: only
// the progress thread (or close) touches the endpoints.
void Engine::abort(const std::string& why) {
  std::unique_lock<std::mutex> lk(mu_);
  if (error_.empty()) error_ = why;
  stop_wire(error_);
  if (!connected_) return;  // no progress thread: close() tears down
  work_cv_.notify_all();
  // Endpoints closed, staging copies drained: no late write into the caller's buffers.
  done_cv_.wait_until(lk, after(std::chrono::seconds(10)), [&] { return closed_; });
}

Pair& Engine::pair(int peer) {
  auto& p = pairs_[peer];
  if (!p) {
    p = std::make_unique<Pair>();
    p->peer = peer;
  }
  return *p;
}

// Slots of a pair's ring: [0, depth) for sends, [depth, 2 depth) for receives,
// allocated at its first staged transfer and registered where the provider asks.
static uint8_t* slot_ptr(Pair& p, const Config& cfg, int slot) { return p.slab + static_cast<uint64_t>(slot) * cfg.chunk; }

bool Engine::start_chunk(Xfer* x) {
  Pair& p = pair(x->op.peer);
  const int dir = x->send() ? 0 : 1;
  if (x->nchunks == 0 && x->next > 0) return false;  // a sized transfer waiting for its first chunk
  if (x->nchunks && x->next >= x->nchunks) return false;
  if (p.inflight[dir] >= cfg_.depth) return false;
  if (push_ && dir == 0) {  // the window: wait for the peer's credits
    if (p.sent - p.credits * quarter_ >= win_) return false;
    p.sent++;
    want_credit(p);
  }
  if (x->staged && !p.slab) {
    const uint64_t bytes = 2ull * cfg_.depth * cfg_.chunk;
    if (cfg_.device >= 0) {
      void* mem = nullptr;
      if (gpu_pinned_alloc(&mem, bytes)) throw std::runtime_error(last_error_message());
      p.slab = static_cast<uint8_t*>(mem);
      p.pinned = true;
      for (int s = 0; s < 2 * cfg_.depth; ++s) {
        void* ev = nullptr;
        if (gpu_event_new(&ev)) throw std::runtime_error(last_error_message());
        p.events.push_back(ev);
      }
    }
    if (!p.slab) p.slab = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
    if (!p.slab) throw std::runtime_error("fabric: out of memory for the staging ring");
    if (mr_local_) {
      for (auto& r : rails_) {
        fid_mr* mr = nullptr;
        check(fi_mr_reg(r.domain, p.slab, bytes, FI_SEND | FI_RECV, 0, 0, 0, &mr, nullptr), "registering the ring");
        p.mrs.push_back(mr);
      }
    }
    for (int s = cfg_.depth - 1; s >= 0; --s) p.free_slots[0].push_back(s), p.free_slots[1].push_back(cfg_.depth + s);
  }
  auto* c = new Chunk;
  c->x = x;
  c->pair = &p;
  c->idx = x->next++;
  c->rail = x->send() ? rail_of(cfg_.rank, x->op.peer, c->idx) : rail_of(x->op.peer, cfg_.rank, c->idx);
  c->off = static_cast<uint64_t>(c->idx) * cfg_.chunk;
  c->len = x->nchunks ? std::min<uint64_t>(cfg_.chunk, x->total - c->off) : std::min<uint64_t>(cfg_.chunk, x->op.len);
  p.inflight[dir]++;
  if (x->staged) {
    c->slot = p.free_slots[dir].back();
    p.free_slots[dir].pop_back();
  }
  if (x->send() && x->staged) {
    c->state = Chunk::CopyOut;
    uint8_t* dst = slot_ptr(p, cfg_, c->slot);
    if (x->op.device) {
      if (gpu_copy_async(dst, x->op.ptr + c->off, c->len, copy_stream_, p.events[c->slot]))
        throw std::runtime_error(last_error_message());
      copying_.push_back(c);
      return true;
    }
    std::memcpy(dst, x->op.ptr + c->off, c->len);
    c->copy_done = true;
    copying_.push_back(c);
    return true;
  }
  c->state = Chunk::Wire;
  if (!post_wire(c)) p.retry.push_back(c);
  return true;
}

// The rail of chunk idx of a message from rank src to rank dst. Each
// direction of a pair has rails of its own, the first (rails + 1) / 2 from
// the lower rank up, the rest down (one rail: both on it): over rxm, a
// rendezvous's read request (and its completion) travels against its data,
// and on a connection that also carried the other direction's chunks it
// queued behind them, so a pair moving both ways at once took 1.6-2x as
// long as one way on a link that binds (bench/NOTES.md, sixth session).
int Engine::rail_of(int src, int dst, uint32_t idx) const {
  const int up = (cfg_.rails + 1) / 2, down = cfg_.rails - up;
  if (src < dst || down == 0) return static_cast<int>(idx % up);
  return up + static_cast<int>(idx % down);
}

bool Engine::post_wire(Chunk* c) {
  Xfer* x = c->x;
  if (x->send() && x->nchunks == 0) {  // chunk 0 of a sized send: its stream's header fixes the length now
    const uint8_t* head = x->staged ? slot_ptr(*c->pair, cfg_, c->slot) : x->op.ptr;
    if (!sized_total(head, c->len, x->op.len, &x->total))
      throw std::runtime_error("a stream to send says it holds " + std::to_string(x->total) +
                               " bytes; a stream holds at least its " + std::to_string(fmt::kFixedHeaderBytes) +
                               "-byte header and at most its " + std::to_string(x->op.len) + "-byte buffer");
    x->nchunks = static_cast<uint32_t>((x->total + cfg_.chunk - 1) / cfg_.chunk);
    c->len = std::min<uint64_t>(cfg_.chunk, x->total);
  }
  Rail& r = rails_[c->rail];
  void* buf = x->staged ? slot_ptr(*c->pair, cfg_, c->slot) : x->op.ptr + c->off;
  void* desc = c->pair->mrs.empty() ? nullptr : fi_mr_desc(c->pair->mrs[c->rail]);
  const int peer = x->op.peer;
  const ssize_t rc = gated(c->rail, [&] {
    return x->send() ? fi_tsend(r.ep, buf, c->len, desc, r.addr[peer], wire_tag(cfg_, cfg_.rank, peer, x->seq, c->idx),
                                &c->ctx)
                     : fi_trecv(r.ep, buf, c->len, desc, directed_ ? r.addr[peer] : FI_ADDR_UNSPEC,
                                wire_tag(cfg_, peer, cfg_.rank, x->seq, c->idx), 0, &c->ctx);
  });
  if (rc == -FI_EAGAIN) return false;  // the post is retried
  if (rc) throw std::runtime_error(std::string(x->send() ? "posting a send to rank " : "posting a receive from rank ") +
                                   std::to_string(peer) + ": " + err_text(static_cast<int>(rc)));
  if (x->send()) rails_used_[peer].fetch_or(1u << c->rail);  // a send opens the rail's connection
  if (r.outstanding.fetch_add(1, std::memory_order_relaxed) == 0) pump_cv_.notify_all();  // a sleeping pump
  return true;
}

// One post on a rail, under the rail's gate (engine.h): -FI_EAGAIN while a
// torn connection is not yet known to be a stranger's (the caller retries),
// else post()'s code; throws once the wire has stopped. A post that
// connects runs rxm's progress too, so its tears are counted here.
template <class Post>
ssize_t Engine::gated(int rail, Post post) {
  std::lock_guard<std::mutex> gate(wire_mu_[rail]);
  if (wire_failed_.load()) throw std::runtime_error(wire_error());
  if (int64_t since = suspect_since_.load()) {  // whose connection tore? (conn_torn)
    const int64_t now = now_ns();
    if (now - since < kSettleNs) return -FI_EAGAIN;
    if (const int peer = down_now_ ? down_now_() : -1; peer >= 0) {
      stop_wire("rank " + std::to_string(peer) + " went while its connection was torn down (" + kConnClosed + ")");
      throw std::runtime_error(wire_error());
    }
    // Strangers' up to now - kSettleNs; a tear since then is still unsettled.
    const int64_t last = last_tear_ns_.load();
    suspect_since_.compare_exchange_strong(since, now - last < kSettleNs ? last : 0);
    if (suspect_since_.load()) return -FI_EAGAIN;
  }
  const uint64_t closes = conn_closes_here();
  const ssize_t rc = post();
  if (const uint64_t now = conn_closes_here(); now != closes) conn_torn(now - closes);
  return rc;
}

// A sender keeps one receive posted for its peer's next credit while one is
// due: the peer sends credit k once it has consumed k quarters of a window,
// so credit credits + 1 is due once that many chunks have been started. A
// credit's tag carries its number (seq) and kCreditIdx, keyed like data.
void Engine::want_credit(Pair& p) {
  if (p.credit_posted || p.sent < (p.credits + 1) * quarter_) return;
  const int rail = rail_of(p.peer, cfg_.rank, 0);  // the peer's direction to us
  auto* c = new Chunk;
  c->pair = &p;
  c->rail = rail;
  Rail& r = rails_[rail];
  const ssize_t rc = gated(rail, [&] {
    return fi_trecv(r.ep, &c->credit, sizeof c->credit, nullptr, directed_ ? r.addr[p.peer] : FI_ADDR_UNSPEC,
                    wire_tag(cfg_, p.peer, cfg_.rank, static_cast<uint32_t>(p.credits + 1), kCreditIdx), 0, &c->ctx);
  });
  if (rc == -FI_EAGAIN) {
    delete c;
    return;  // the run loop asks again
  }
  if (rc) {
    delete c;
    throw std::runtime_error("posting a credit receive from rank " + std::to_string(p.peer) + ": " +
                             err_text(static_cast<int>(rc)));
  }
  p.credit_posted = true;
  if (r.credit_waits.fetch_add(1, std::memory_order_relaxed) == 0) pump_cv_.notify_all();
}

// A receiver sends credit k (its number in the tag, k quarters in the
// payload) once it has consumed k quarters of a window from the peer:
// injected (no completion to track; rxm copies the 8 bytes at once).
void Engine::send_credits(Pair& p) {
  if (gone_peer_[p.peer].load()) return;  // it said goodbye or died: no one reads them
  while (p.consumed >= (p.credited + 1) * quarter_) {
    const uint64_t k = p.credited + 1, val = k * quarter_;
    const int rail = rail_of(cfg_.rank, p.peer, 0);  // our direction to the peer
    Rail& r = rails_[rail];
    const ssize_t rc = gated(rail, [&] {
      return fi_tinject(r.ep, &val, sizeof val, r.addr[p.peer],
                        wire_tag(cfg_, cfg_.rank, p.peer, static_cast<uint32_t>(k), kCreditIdx));
    });
    if (rc == -FI_EAGAIN) return;  // the run loop sends it later
    if (rc)
      throw std::runtime_error("sending a credit to rank " + std::to_string(p.peer) + ": " +
                               err_text(static_cast<int>(rc)));
    rails_used_[p.peer].fetch_or(1u << rail);  // it opens the rail's connection, as a send does
    p.credited = k;
  }
}

void Engine::on_wire_done(Chunk* c, uint64_t len) {
  if (!c->x) {  // a credit arrived
    Pair& p = *c->pair;
    rails_[c->rail].credit_waits.fetch_sub(1, std::memory_order_relaxed);
    rails_used_[p.peer].fetch_or(1u << c->rail);  // a receive came over the rail's connection
    const uint64_t k = p.credits + 1;
    const uint64_t got = c->credit;
    delete c;
    if (len != sizeof got || got != k * quarter_)
      throw std::runtime_error("rank " + std::to_string(p.peer) + " sent a garbled credit (" + std::to_string(len) +
                               " bytes, " + std::to_string(got) + " chunks where " + std::to_string(k * quarter_) +
                               " were due)");
    p.credits = k;
    p.credit_posted = false;
    want_credit(p);
    return;
  }
  rails_[c->rail].outstanding.fetch_sub(1, std::memory_order_relaxed);
  Xfer* x = c->x;
  const int peer = x->op.peer;
  if (push_ && !x->send()) {  // its bytes left rxm's hands: one chunk less in the window
    c->pair->consumed++;
    send_credits(*c->pair);
  }
  if (!x->send()) {
    const uint8_t* got = x->staged ? slot_ptr(*c->pair, cfg_, c->slot) : x->op.ptr + c->off;
    if (x->nchunks == 0) {  // chunk 0 of a sized receive: the header says how long the stream is
      uint64_t total;
      if (!sized_total(got, len, x->op.len, &total) || len != std::min<uint64_t>(total, cfg_.chunk))
        throw std::runtime_error("rank " + std::to_string(peer) + " sent a stream whose header claims " +
                                 std::to_string(total) + " bytes (first chunk " + std::to_string(len) +
                                 " bytes, room for " + std::to_string(x->op.len) + ")");
      x->total = total;
      x->nchunks = static_cast<uint32_t>((total + cfg_.chunk - 1) / cfg_.chunk);
      c->len = len;
    } else if (len != c->len) {
      throw std::runtime_error("rank " + std::to_string(peer) + " sent " + std::to_string(len) + " bytes where " +
                               std::to_string(c->len) + " were expected");
    }
    if (x->staged) {
      c->state = Chunk::CopyIn;
      if (x->op.device) {
        if (gpu_copy_async(x->op.ptr + c->off, got, c->len, copy_stream_, c->pair->events[c->slot]))
          throw std::runtime_error(last_error_message());
        copying_.push_back(c);
        return;
      }
      std::memcpy(x->op.ptr + c->off, got, c->len);
    }
  }
  finish_chunk(c);
}

void Engine::finish_chunk(Chunk* c) {
  Xfer* x = c->x;
  Pair& p = *c->pair;
  const int dir = x->send() ? 0 : 1;
  p.inflight[dir]--;
  if (c->slot >= 0) p.free_slots[dir].push_back(c->slot);
  if (!x->send()) rails_used_[x->op.peer].fetch_or(1u << c->rail);  // a receive came over the rail's connection
  delete c;
  if (++x->done == x->nchunks) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = batches_.find(x->batch);
      if (it != batches_.end()) {
        it->second.lens[x->index] = x->total;
        it->second.left--;
      }
    }
    done_cv_.notify_all();
    x->finished = true;
    if (!x->queued) delete x;  // else its FIFO still holds it (a sized transfer of one chunk): advance() frees it
  }
}

bool Engine::advance(Pair& p, int dir) {
  bool busy = false;
  while (!p.q[dir].empty()) {
    Xfer* x = p.q[dir].front();
    while (start_chunk(x)) busy = true;
    if (!x->nchunks || x->next < x->nchunks) break;  // FIFO: later transfers wait for this one's chunks
    p.q[dir].pop_front();
    x->queued = false;
    if (x->finished) delete x;
  }
  return busy;
}

// One read of a completion queue, appended to out as Done records (an error
// entry or a failed read becomes one record with err set); returns how many.
static size_t read_cq(fid_cq* cq, std::vector<Done>* out) {
  fi_cq_tagged_entry ev[16];
  const ssize_t n = fi_cq_read(cq, ev, 16);
  if (n == -FI_EAGAIN) return 0;
  if (n > 0) {
    for (ssize_t i = 0; i < n; ++i) out->push_back({static_cast<Chunk*>(ev[i].op_context), ev[i].len, 0, 0});
    return static_cast<size_t>(n);
  }
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry e{};
    fi_cq_readerr(cq, &e, 0);
    out->push_back({static_cast<Chunk*>(e.op_context), 0, e.err ? e.err : FI_EIO, e.prov_errno});
  } else {
    out->push_back({nullptr, 0, static_cast<int>(-n), 0});
  }
  return 1;
}

// What a completion error says, naming the transfer's peer.
static std::string done_error(const Done& d) {
  const Chunk* c = d.c;
  const std::string who = !c      ? std::string("a transfer")
                          : !c->x ? "a credit from rank " + std::to_string(c->pair->peer)
                                  : (c->x->send() ? "sending to rank " : "receiving from rank ") +
                                        std::to_string(c->x->op.peer);
  return who + " failed (peer likely dead): " + err_text(d.err) +
         (d.prov_errno ? ", provider errno " + std::to_string(d.prov_errno) : "");
}

// One read of rail r's queue, under its gate; an error stops every post (engine.h).
size_t Engine::read_rail(int r, std::vector<Done>* out) {
  std::lock_guard<std::mutex> gate(wire_mu_[r]);
  const size_t first = out->size();
  const uint64_t closes = conn_closes_here();
  const size_t n = read_cq(rails_[r].cq, out);
  for (size_t i = first; i < out->size(); ++i)
    if ((*out)[i].err) stop_wire(done_error((*out)[i]));
  if (const uint64_t now = conn_closes_here(); now != closes) conn_torn(now - closes);
  return n;
}

void Engine::pump(int r) {
  std::vector<Done> got;
  int idle = 0;
  while (!pump_stop_.load(std::memory_order_relaxed)) {
    if (wire_failed_.load()) {  // the engine is failing: no more progress into the provider until teardown
      std::unique_lock<std::mutex> lk(pump_mu_);
      pump_cv_.wait_until(lk, after(std::chrono::milliseconds(2)));
      continue;
    }
    if (!read_rail(r, &got)) {
      // With operations outstanding on this rail, nap briefly (bytes may be
      // arriving); with none, sleep until the progress thread posts here.
      if (++idle > cfg_.spin) {
        std::unique_lock<std::mutex> lk(pump_mu_);
        if (rails_[r].outstanding.load(std::memory_order_relaxed) > 0 ||
            rails_[r].credit_waits.load(std::memory_order_relaxed) > 0)
          pump_cv_.wait_until(lk, after(std::chrono::microseconds(20)));
        else
          pump_cv_.wait_until(lk, after(std::chrono::milliseconds(2)));
      }
      continue;
    }
    idle = 0;
    {
      std::lock_guard<std::mutex> g(cq_mu_);
      done_.insert(done_.end(), got.begin(), got.end());
    }
    got.clear();
    cq_cv_.notify_one();
  }
}

bool Engine::poll_cqs() {
  std::vector<Done> got;
  if (!pumps_.empty()) {  // the rails' pump threads read the queues: take what they found
    std::lock_guard<std::mutex> g(cq_mu_);
    got.swap(done_);
  } else {
    for (int r = 0; r < static_cast<int>(rails_.size()); ++r)
      while (read_rail(r, &got) == 16) {
      }
  }
  for (const Done& d : got) {
    if (d.err) throw std::runtime_error(done_error(d));
    on_wire_done(d.c, d.len);
  }
  return !got.empty();
}

bool Engine::poll_copies() {
  bool busy = false;
  for (size_t i = 0; i < copying_.size();) {
    Chunk* c = copying_[i];
    int done = c->copy_done ? 1 : 0;
    if (!done) {
      done = gpu_event_done(c->pair->events[c->slot]);
      if (done < 0 || done == kRuntimeError) throw std::runtime_error(last_error_message());
    }
    if (!done) {
      ++i;
      continue;
    }
    copying_[i] = copying_.back();
    copying_.pop_back();
    busy = true;
    if (c->state == Chunk::CopyOut) {
      c->state = Chunk::Wire;
      if (!post_wire(c)) c->pair->retry.push_back(c);
    } else {
      finish_chunk(c);
    }
  }
  return busy;
}

void Engine::run() {
  if (cfg_.device >= 0) gpu_set_device(cfg_.device);
  int idle = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stop_ || !error_.empty()) break;
      const bool active = !copying_.empty() || std::any_of(pairs_.begin(), pairs_.end(), [](const auto& kv) {
        return kv.second->inflight[0] || kv.second->inflight[1] || !kv.second->q[0].empty() || !kv.second->q[1].empty();
      });
      if (!active && incoming_.empty()) {
        work_cv_.wait_until(lk, after(std::chrono::milliseconds(20)));
        idle = 0;
      }
      while (!incoming_.empty()) {
        Xfer* x = incoming_.front();
        incoming_.pop_front();
        pair(x->op.peer).q[x->send() ? 0 : 1].push_back(x);
      }
    }
    try {
      bool busy = false;
      for (auto& kv : pairs_) {
        Pair& p = *kv.second;
        for (size_t i = 0; i < p.retry.size();) {
          if (post_wire(p.retry[i])) {
            p.retry.erase(p.retry.begin() + static_cast<long>(i));
            busy = true;
          } else {
            ++i;
          }
        }
        if (push_) {  // credits a gate or the provider deferred
          want_credit(p);
          send_credits(p);
        }
        busy |= advance(p, 0);
        busy |= advance(p, 1);
      }
      busy |= poll_copies();
      busy |= poll_cqs();
      if (push_) {  // the credits still due from peers still here, for drain()
        int64_t due = 0;
        for (auto& kv : pairs_)
          if (!gone_peer_[kv.first].load()) due += static_cast<int64_t>(kv.second->sent / quarter_ - kv.second->credits);
        credits_due_.store(due);
        passes_.fetch_add(1);
      }
      // Spin while data moves (tcp and rxm progress inside fi_cq_read), then
      // back off to sleeps of up to 0.5 ms: a thread spinning on a shared core
      // would starve the very ranks it waits for (PZ_FABRIC_SPIN: polls first).
      idle = busy ? 0 : idle + 1;
      if (!pumps_.empty() && !busy) {  // wait for a pump's news (staging copies: polled every 50 us)
        std::unique_lock<std::mutex> lk(cq_mu_);
        cq_cv_.wait_until(lk, after(std::chrono::microseconds(copying_.empty() ? 500 : 50)),
                          [&] { return !done_.empty(); });
      } else if (idle > cfg_.spin)
        std::this_thread::sleep_for(std::chrono::microseconds(std::min(500, 10 << std::min(idle - cfg_.spin, 6))));
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  teardown();
  {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
  }
  done_cv_.notify_all();
}

void Engine::fail(const std::string& why) {
  stop_wire(why);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (error_.empty()) error_ = why;
  }
  done_cv_.notify_all();
}

void Engine::conn_torn(uint64_t n) {
  last_tear_ns_.store(now_ns());
  const uint64_t tears = tears_.fetch_add(n) + n;
  if (!watched_.load() || gone_.load() >= 0) {
    stop_wire(kConnClosed);
    return;
  }
  if (tears <= quiet_credit_.load()) return;  // quiet closes explain them
  int64_t none = 0;
  suspect_since_.compare_exchange_strong(none, last_tear_ns_.load());  // the first unsettled tear's time
  if (gone_.load() >= 0)
    stop_wire(kConnClosed);  // peer_gone ran meanwhile and saw no suspicion yet
  else
    resume_if_explained();  // a quiet goodbye came meanwhile and found none to clear
}

void Engine::resume_if_explained() {
  if (tears_.load() > quiet_credit_.load()) return;
  int64_t since = suspect_since_.load();
  if (since) suspect_since_.compare_exchange_strong(since, 0);
}

void Engine::peer_gone(int peer, bool quiet) {
  if (peer >= 0 && peer < cfg_.world) gone_peer_[peer].store(1);  // no credits to or from it any more
  if (quiet && trust_quiet_) {
    uint64_t used = 0;  // the rails whose connection to it can tear
    const uint32_t bits = peer >= 0 && peer < cfg_.world ? rails_used_[peer].load() : (1u << cfg_.rails) - 1;
    for (int r = 0; r < cfg_.rails; ++r) used += bits >> r & 1;
    quiet_credit_.fetch_add(used);
    resume_if_explained();
    return;
  }
  int none = -1;
  gone_.compare_exchange_strong(none, peer);
  const int64_t now = now_ns(), since = suspect_since_.load(), last = last_tear_ns_.load();
  if (since || (last && now - last < kStrangerNs))
    stop_wire("rank " + std::to_string(peer) + " went while its connection was torn down (" + kConnClosed + ")");
}

bool Engine::quiet() {
  std::lock_guard<std::mutex> g(mu_);  // first: teardown does not begin while stop_ and closed_ are unset
  if (stop_ || closed_ || !error_.empty() || wire_failed_.load() || !incoming_.empty()) return false;
  for (const auto& r : rails_)
    if (r.outstanding.load() > 0) return false;
  for (const auto& [id, b] : batches_)
    if (b.left > 0) return false;  // a transfer not yet on the wire, or not done
  return true;
}

void Engine::stop_wire(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(cq_mu_);
    if (wire_error_.empty()) wire_error_ = why;
  }
  wire_failed_.store(true);
  cq_cv_.notify_all();  // the progress thread: stop waiting for pumps' news
}

std::string Engine::wire_error() {
  std::lock_guard<std::mutex> g(cq_mu_);
  return wire_error_;
}

void Engine::stop_pumps() {
  pump_stop_ = true;
  pump_cv_.notify_all();
  for (auto& t : pumps_) t.join();
  pumps_.clear();
}

void Engine::teardown() {
  stop_pumps();
  // Closing an endpoint whose peer died with transfers in flight crashes
  // inside rxm (its close flushes completions that name the dead
  // connection; seen with the peer's death noticed first by the watch, the
  // connection not yet torn, and with it torn). So while any transfer is
  // still posted, or after an error on a torn connection, the endpoints (and
  // their queues, vectors, domains) are left open: rxm moves data only
  // inside our calls (manual progress), so none moves any more. A leak per
  // such engine. With nothing posted the endpoints close, also when a peer
  // has gone (its close or its death tears the connection and the watch
  // tells of it: the common end of a clean job, and of a failed setup).
  bool keep = false;
  for (const auto& r : rails_) keep = keep || r.outstanding.load() > 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    keep = keep || (tears_.load() > 0 && !error_.empty());
  }
  for (auto& r : rails_) {  // no posted operation outlives this: the provider cancels them
    if (r.ep && !keep) fi_close(&r.ep->fid);
    r.ep = nullptr;
  }
  // Staging copies still queued touch user memory and the slots: let them end.
  for (int spin = 0; spin < 100000 && !copying_.empty(); ++spin) {
    copying_.erase(std::remove_if(copying_.begin(), copying_.end(), [](Chunk* c) {
      return c->copy_done || gpu_event_done(c->pair->events[c->slot]) != 0;
    }), copying_.end());
  }
  copying_.clear();
  for (auto& kv : pairs_) {
    Pair& p = *kv.second;
    for (fid_mr* mr : p.mrs) fi_close(&mr->fid);
    for (void* ev : p.events) gpu_event_free(ev);
    if (p.slab && p.pinned) gpu_pinned_free(p.slab);
    if (p.slab && !p.pinned) std::free(p.slab);
    p.slab = nullptr;
    p.events.clear();
  }
  pairs_.clear();  // the transfers and chunks they held are leaked on purpose: the provider may still name them
  if (keep) {  // the rails' queues, vectors and domains stay with their endpoints
    rails_.clear();
    fabric_ = nullptr;
  } else {
    close_endpoints();
  }
  if (order_event_) gpu_event_free(order_event_);
  if (copy_stream_) gpu_stream_free(copy_stream_);
  order_event_ = copy_stream_ = nullptr;
}

bool Engine::drain(double timeout_s) {
  if (!push_) return true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  // Trust only a count from a pass that began after this call: two passes on.
  const uint64_t first = passes_.load();
  while (passes_.load() < first + 2 || credits_due_.load() > 0) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_ || stop_ || !connected_ || !error_.empty() || wire_failed_.load()) return false;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void Engine::close() {
  std::lock_guard<std::mutex> once(close_mu_);  // a second caller waits for the first
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  bool torn;
  {
    std::lock_guard<std::mutex> g(mu_);
    torn = closed_;
  }
  if (torn) return;
  teardown();
  {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
  }
  done_cv_.notify_all();
}

std::map<std::string, std::string> Engine::info() const {
  std::map<std::string, std::string> m;
  std::lock_guard<std::mutex> g(mu_);
  const Lib& L = lib();
  const uint32_t v = L.version();
  m["library"] = L.path;
  m["version"] = std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v));
  m["provider"] = info_ ? info_->fabric_attr->prov_name : "";
  m["fabric"] = info_ && info_->fabric_attr->name ? info_->fabric_attr->name : "";
  m["domain"] = info_ && info_->domain_attr->name ? info_->domain_attr->name : "";
  m["rails"] = std::to_string(cfg_.rails);
  m["chunk"] = std::to_string(cfg_.chunk);
  m["depth"] = std::to_string(cfg_.depth);
  m["push"] = push_ ? "eager chunks, a window of " + std::to_string(win_) + " chunks (" +
                          std::to_string(win_ * cfg_.chunk) + " bytes), rxm eager limit " + std::to_string(eager_limit_)
                    : "off (rendezvous)";
  m["threads"] = threads_safe_ ? "a pump per rail + progress (FI_THREAD_SAFE)" : "one progress thread";
  m["hmem"] = hmem_ ? "offered (device memory still staged)" : "no";
  m["mr_local"] = mr_local_ ? "yes (host memory staged through registered slots)" : "no";
  m["keyed_tags"] = "yes (SipHash-2-4 Feistel permutation under the group's secret, per receiver)";
  m["connections_torn"] = std::to_string(tears_.load());
  m["quiet_goodbyes"] = trust_quiet_ ? "trusted (rxm over tcp, dynamic receive buffers)" : "count as deaths";
  m["directed_recv"] = directed_ ? "yes (FI_DIRECTED_RECV: a receive matches its peer's address only)" : "no (tags alone)";
  m["bind"] = bind_ip_.empty() ? "the provider's default interface" : bind_ip_;
  m["endpoint"] = endpoint_;
  m["error"] = error_;
  return m;
}

}  // namespace pz::fabric
