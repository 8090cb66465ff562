// The fabric engine: libfabric RDM endpoints ("rails") to every peer, tagged
// messages cut into chunks striped round-robin over their direction's rails, a pinned
// staging ring per peer for memory the provider cannot send from, and one
// progress thread. Python posts a batch of transfers and waits on it.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>  // ssize_t

struct fi_info;
struct fid_fabric;
struct fid_domain;
struct fid_ep;
struct fid_mr;
struct fid_cq;
struct fid_av;

namespace pz::fabric {

// Send/Recv move exactly len bytes. The sized kinds move a portable_zip
// stream of at most len bytes (len: a fixed stream header at least) whose
// real length is its header's total, which the format reads
// (fmt::stream_total_bytes) from the first chunk: the sender's engine before
// posting it (GPU memory: once staged), the receiver's once it arrives. No
// size round trip, no host sync.
enum class Kind : int { Send = 0, Recv = 1, SendSized = 2, RecvSized = 3 };

struct Op {
  Kind kind;
  int peer;
  uint8_t* ptr;
  uint64_t len;
  bool device;  // GPU memory: staged through pinned host slots
};

struct Config {
  std::string provider;       // "" = auto: shm (one host), efa, verbs;ofi_rxm, tcp (>= 1.18), tcp;ofi_rxm
  // 0: the provider's default, resolved once it is chosen (push: 1 rail of 256 KiB chunks; else 2 of 2 MiB).
  int rails = 0;              // endpoints per peer, chunks striped over them
  uint64_t chunk = 0;         // bytes per chunk (and per staging slot)
  int depth = 0;              // chunks in flight per peer and direction (= staging slots; 0: max(4, 2 x rails))
  // Push (tcp;ofi_rxm only): every chunk travels eagerly, no read request
  // from the receiver, and a sender may have at most `window` bytes (whole
  // chunks, 4 at least) beyond those its peer has received: the peer's
  // credits say how many. -1: 4 MiB where push applies; 0: off (rendezvous).
  int64_t window = -1;
  bool stage_host = false;    // stage host memory too (what FI_MR_LOCAL providers need; tests the ring on CPU)
  int device = -1;            // GPU ordinal for staging copies (-1: a CPU rank)
  int rank = 0, world = 1;
  bool same_host = false;     // every rank on this host: auto tries shm first
  int spin = 2000;            // idle polls before the progress thread starts sleeping
  std::string secret;         // the group's 16 random bytes: keys every tag (keyed.h), so only its ranks match
  std::string iface;          // an IPv4 address or an interface to bind to ("" and not same_host: libfabric's choice)
};

struct Chunk;
struct Xfer;
struct Pair;

// A completion read from a rail's queue: the chunk, the bytes it moved, or an error.
struct Done {
  Chunk* c;
  uint64_t len;
  int err, prov_errno;
};

class Engine {
 public:
  explicit Engine(const Config& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::string address() const;                          // this rank's rails' names, concatenated
  void connect(const std::vector<std::string>& addrs);  // every rank's address(), in rank order
  uint64_t post(const std::vector<Op>& ops, void* user_stream);
  // 0: done (lens: bytes moved per op); 1: timed out. Throws on a transfer error.
  // After a timeout or an error the engine is closed: no op can touch user memory later.
  int wait(uint64_t batch, double timeout_s, std::vector<uint64_t>* lens);
  std::map<std::string, std::string> info() const;
  // Cancel everything posted (an exchange failed with transfers still in
  // flight): the engine closes, and later posts raise with why.
  void abort(const std::string& why);
  void close();
  // With a liveness watch (watch.h): it says which peers have gone, so a
  // connection the provider tore down is told apart from a stranger's.
  // quiet: the peer closed with nothing of its own in flight, so what it
  // sent before is still delivered and its tear stops nothing.
  // down_now: the peer that has gone (-1: none), asked of the watch's
  // sockets now (Watch::peer_down_now): a tear with none down is a stranger's.
  void set_watched(std::function<int()> down_now) {
    down_now_ = std::move(down_now);
    watched_.store(true);
  }
  void peer_gone(int peer, bool quiet);
  // Nothing posted is still in flight and nothing failed: this rank's goodbye says so.
  bool quiet();
  // Push: waits up to timeout_s for the credits due for what this rank sent
  // to peers still here (false: some did not come), before close(). A
  // credit left unread when the endpoints close makes this host's kernel
  // reset the connection, and the peer's would drop what it has not read yet.
  bool drain(double timeout_s);

 private:
  static constexpr uint32_t kCreditIdx = 0xFFFFFF;  // a credit's chunk field: no data chunk has it
  struct Batch {
    int left = 0;
    std::vector<uint64_t> lens;
  };
  struct Rail {
    fid_domain* domain = nullptr;
    fid_ep* ep = nullptr;
    fid_cq* cq = nullptr;
    fid_av* av = nullptr;
    std::string name;
    std::vector<uint64_t> addr;  // fi_addr_t of every rank
    std::atomic<int> outstanding{0};  // posted, not yet completed (its pump naps, not sleeps)
    std::atomic<int> credit_waits{0};  // credit receives posted (the pump naps for them too; no transfer)
    Rail() = default;
    Rail(const Rail&) : Rail() {}  // for vector::assign before any use
    Rail& operator=(const Rail& o) {
      domain = o.domain, ep = o.ep, cq = o.cq, av = o.av, name = o.name, addr = o.addr;
      outstanding.store(o.outstanding.load());
      credit_waits.store(o.credit_waits.load());
      return *this;
    }
  };

  void open_provider();
  void resolve(const std::string& prov, bool may_push = true);  // cfg_ from want_ for a candidate provider
  void open_endpoints();
  void close_endpoints();
  void run();                 // the progress thread
  bool advance(Pair& p, int dir);
  bool start_chunk(Xfer* x);
  int rail_of(int src, int dst, uint32_t idx) const;
  bool post_wire(Chunk* c);
  void on_wire_done(Chunk* c, uint64_t len);
  void finish_chunk(Chunk* c);
  bool poll_cqs();
  size_t read_rail(int rail, std::vector<Done>* out);
  void pump(int rail);  // a rail's pump thread
  void stop_pumps();
  bool poll_copies();
  void fail(const std::string& why);
  void want_credit(Pair& p);   // a sender's credit receive, posted while a credit is due
  void send_credits(Pair& p);  // a receiver's credits, one per quarter window consumed
  template <class Post>
  ssize_t gated(int rail, Post post);  // one post under the rail's gate (engine.cpp)
  void stop_wire(const std::string& why);  // post nothing more: the first failure's text is kept
  void conn_torn(uint64_t n);  // rxm tore n connections down in this thread's last call
  void resume_if_explained();  // quiet goodbyes explain every tear so far: no suspicion left
  std::string wire_error();
  void teardown();
  Pair& pair(int peer);

  Config want_;  // as asked (0: the provider's default)
  Config cfg_;   // as resolved for the provider in use
  bool push_ = false;
  uint32_t win_ = 0, quarter_ = 0;  // push: the window and a credit, in chunks
  uint64_t eager_limit_ = 0;        // tcp;ofi_rxm: rxm's effective eager limit (in the address)
  std::atomic<uint64_t> passes_{0};       // progress-thread passes that stored credits_due_
  std::atomic<int64_t> credits_due_{0};  // credits due from peers still here (the progress thread's count, for drain())
  std::unique_ptr<std::atomic<uint8_t>[]> gone_peer_;  // per peer: said goodbye or died (peer_gone)
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  std::vector<Rail> rails_;
  bool mr_local_ = false, hmem_ = false, threads_safe_ = false, directed_ = false;
  std::string bind_ip_;   // the IPv4 address the endpoints listen on ("": the provider's choice)
  std::string endpoint_;  // rail 0's name as text, for info()
  std::mutex cq_mu_;  // the pumps' completions, for the progress thread
  std::condition_variable cq_cv_;
  std::vector<Done> done_;
  std::vector<std::thread> pumps_;
  std::atomic<bool> pump_stop_{false};
  std::mutex pump_mu_;  // sleeping pumps wait on pump_cv_; a post to an idle rail wakes them
  std::condition_variable pump_cv_;
  // libfabric 1.17's rxm tears a dead peer's connection down inside a
  // progress call (a queue read, a connecting send) but leaves that peer's
  // rendezvous requests queued as unexpected messages pointing at it: a
  // receive posted later that matches one reads through the closed
  // connection's NULL endpoint (SIGSEGV). So per rail a queue read and a post
  // never overlap, and once a call has torn a connection down
  // (conn_closes_here), a read has returned an error, or the engine failed,
  // nothing more is posted on any rail.
  std::mutex wire_mu_[16];               // per rail (PZ_FABRIC_RAILS <= 16)
  std::atomic<bool> wire_failed_{false};
  std::atomic<bool> watched_{false};     // a liveness watch reports peers that go (peer_gone)
  std::atomic<int> gone_{-1};            // the first peer the watch saw go other than quietly
  std::atomic<uint64_t> tears_{0};       // connections rxm has torn down (any: teardown may leave endpoints open)
  std::atomic<uint64_t> quiet_credit_{0};  // tears quiet goodbyes explain: one per rail used with the peer
  // Per peer, the rails whose connection to it carried a send of ours or a
  // completed receive (a bit a rail): those a quiet goodbye explains. Each
  // direction has rails of its own, so a pair moving bytes one way opens
  // only that direction's; crediting every rail would let the surplus
  // explain away a later death's tear.
  std::unique_ptr<std::atomic<uint32_t>[]> rails_used_;
  std::atomic<int64_t> last_tear_ns_{0};   // steady-clock ns of the last tear
  bool trust_quiet_ = false;  // the provider keeps no connection state in unmatched messages (engine.cpp)
  std::atomic<int64_t> suspect_since_{0};  // steady-clock ns: a torn connection not yet known to be a peer's
  std::function<int()> down_now_;          // set once, before any post (set_watched)
  std::string wire_error_;               // under cq_mu_
  std::mutex close_mu_;                  // close() from several threads: one tears down
  void* copy_stream_ = nullptr;
  void* order_event_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Xfer*> incoming_;
  std::map<uint64_t, Batch> batches_;
  std::map<int, std::unique_ptr<Pair>> pairs_;  // progress thread only
  std::vector<Chunk*> copying_;                 // progress thread only
  uint64_t next_batch_ = 1;
  std::vector<uint32_t> send_seq_, recv_seq_;   // per peer, under mu_
  std::string error_;
  bool stop_ = false, closed_ = false, connected_ = false;
  std::thread thread_;
};

std::string probe();  // "" when libfabric loads, else why not
// The IPv4 address endpoints bind to: loopback when every rank is on this
// host, else iface (an IPv4 address, or an interface's), else "" (libfabric's default).
// An unknown interface, or one without an IPv4 address, is invalid_argument.
std::string bind_address(const std::string& iface, bool same_host);

}  // namespace pz::fabric
