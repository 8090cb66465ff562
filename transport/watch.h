// The liveness watch: one thread and one TCP connection per peer, so every
// rank of a Communicator notices a peer that died within seconds, whatever
// the op's timeout, on every transport. Plain POSIX sockets (no libfabric):
// built always. A connection counts only after both ends prove the group's
// secret (a SipHash-2-4 MAC over fresh nonces, keyed.h). A peer that is
// silent for `silence_s` (no heartbeat; one a second, from this thread, so a
// busy Python peer still beats) is dead: every wait fails. A peer whose
// connection closes (the kernel closes a dead process's sockets) or that
// says goodbye (an orderly close) has gone: a wait still open on it fails.
// A goodbye also says whether the closing rank's transport was quiet
// (nothing of its own still in flight): what a quiet peer sent before it
// left is still delivered.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace pz::watch {

class Watch {
 public:
  // host: the numeric address to listen on; iface (if not empty) wins: its
  // first IPv4 address (else IPv6). global: every group rank's global rank.
  // port_lo..port_hi: the ports it may listen on (0, 0: the kernel picks).
  Watch(int rank, const std::vector<int64_t>& global, const std::string& secret, double silence_s,
        const std::string& host, const std::string& iface, int port_lo = 0, int port_hi = 0);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  std::string address() const;  // "host port" this rank listens on
  // Every rank's address() in rank order: connect to the lower ranks, accept
  // the higher ones, both ends authenticated; then the heartbeat thread
  // starts. Throws on a timeout or a bad address.
  void connect(const std::vector<std::string>& addrs, double timeout_s);
  // The same in slices: false when slice_s ends first (call again; the
  // caller checks meanwhile whether a peer gave up), true once connected.
  // Throws on a refused dial, a bad address or a failed handshake.
  bool connect_for(const std::vector<std::string>& addrs, double slice_s);
  std::vector<int> missing() const;  // ranks not connected yet
  // The first failure seen: a peer's death, or a peer that closed while this
  // rank waited on it. False while every peer lives.
  bool failed(int* rank, std::string* why) const;
  // Peers whose connection closed without a goodbye: (rank, why).
  std::vector<std::pair<int, std::string>> departed() const;
  // Waits in progress on these peers (+1 when one starts, -1 when it ends):
  // a peer that has gone (closed or died) while one is open for 1 s fails it.
  void expect(const std::vector<int>& peers, int delta);
  // on_failure: called once, from the watch thread, at the first failure
  // (the fabric engine's abort: a blocked wait raises at once). on_gone:
  // from the watch thread, each time a peer's connection closes or it says
  // goodbye (the engine learns whose connection its provider tore down),
  // with whether it left quiet. quiet: asked at close, for this rank's goodbye.
  void attach(std::function<void(const std::string&)> on_failure, std::function<void(int, bool)> on_gone = nullptr,
              std::function<bool()> quiet = nullptr);
  void close();  // goodbye to every peer, join the thread, close every fd
  // A peer that has gone other than by a quiet goodbye (-1: none), asked
  // now of its socket too (a hangup the watch thread has not read yet
  // counts): the fabric engine's test of whose connection tore. -1 once closed.
  int peer_down_now();

 private:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    int fd = -1;
    bool bye = false;                   // said goodbye: its close is not a death
    bool quiet = false;                 // its goodbye said nothing of its own was in flight
    std::string gone;                   // why it went (goodbye or closed connection); "" while here
    Clock::time_point heard, gone_at, expect_since;
    std::atomic<int> expect{0};
    Peer() = default;
    Peer(const Peer&) : Peer() {}       // for vector construction only
  };
  struct Pending;
  std::vector<Pending> pend_;  // connect_for's half-open handshakes, kept across slices
  std::vector<std::string> dial_;  // one per rank
  bool dialed_ = false;
  std::string at(int peer) const;  // the address dialed for a lower rank
  void run();
  void fail(int peer, const std::string& why);
  std::string who(int peer) const;

  const int rank_, world_;
  const std::vector<int64_t> global_;
  uint8_t key_[16];
  const double silence_s_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // close() wakes the thread through this pipe
  std::string address_;
  std::vector<Peer> peers_;
  std::thread thread_;
  std::thread aborter_;  // runs on_failure_ once
  mutable std::mutex mu_;  // failure fields, on_failure_, gone, gone_at, expect_since
  std::mutex fd_mu_;       // peer fds' closing in run() and close(), against peer_down_now()
  bool failed_ = false;
  int failed_rank_ = -1;
  std::string why_;
  std::function<void(const std::string&)> on_failure_;
  std::function<void(int, bool)> on_gone_;
  std::function<bool()> quiet_;
  void went(int peer);  // on_gone_, outside mu_
  bool closed_ = false;
};

}  // namespace pz::watch
