// The liveness watch (watch.h). Handshake, per pair (the higher rank connects):
//   connector -> acceptor  HELLO     magic, from, to, nonce_c
//   acceptor  -> connector CHALLENGE nonce_a, MAC("A", nonce_c, nonce_a, from, to)
//   connector -> acceptor  PROOF     MAC("C", nonce_a, nonce_c, from, to)
// MACs are SipHash-2-4 under the group's secret over fresh nonces from both
// ends, so neither a stranger nor a replay passes; anything else is closed.
// Afterwards each end sends BEAT ('B') once a second (4 per heartbeat timeout
// if that is shorter) and a goodbye on close: 'G' if its transport was quiet, else 'F'.
#include "watch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "iface.h"
#include "keyed.h"

namespace pz::watch {
namespace {

constexpr uint32_t kMagic = 0x32575a50;  // "PZW2": goodbyes say whether the closing rank was quiet
// Goodbyes: 'G' from a rank whose transport was quiet at close (every
// transfer it posted had completed), 'F' from one that closed with transfers
// in flight (after a failure): a peer treats the tear of its connection as a death's.
constexpr char kBeat = 'B', kBye = 'G', kByeBusy = 'F';
constexpr double kBeatS = 1.0;  // at most: a heartbeat timeout under 4 s beats 4 times in it
// A wait open on a peer that has gone (exited, killed) fails after this:
// what it sent before it went lands well within it.
constexpr double kGoneGraceS = 1.0;
// After a goodbye (an orderly close) the grace is longer: a correct program
// whose ranks leave at different times must never fail, and on a loaded
// machine the last bytes a peer sent before closing took over 1 s to be
// read (a 3-rank staging test in CI). Only a program that waits on a peer
// that closed early waits this long for its error.
constexpr double kByeGraceS = 3.0;
constexpr size_t kHello = 20, kChallenge = 16, kProof = 8;
constexpr int kMaxStrangers = 64;  // unproven connections held at once during connect(); the oldest go first
constexpr double kHandshakeS = 10.0;  // an accepted connection that has not proven the secret by then is closed

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t, Clock::time_point now) { return std::chrono::duration<double>(now - t).count(); }

void put32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i)); }
void put64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i)); }
uint32_t get32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint64_t get64(const uint8_t* p) { return keyed::load_le64(p); }

uint64_t mac(const uint8_t key[16], char side, uint64_t n1, uint64_t n2, uint32_t from, uint32_t to) {
  uint8_t m[12 + 24];
  std::memcpy(m, "pz-watch-v1", 11);  // domain separation from the secret's other uses
  m[11] = uint8_t(side);
  put64(m + 12, n1), put64(m + 20, n2), put32(m + 28, from), put32(m + 32, to);
  return keyed::siphash24(key, m, sizeof m);
}

uint64_t nonce() {
  uint64_t v;
  if (getrandom(&v, sizeof v, 0) != sizeof v) throw std::runtime_error("liveness watch: getrandom failed");
  return v;
}

void nonblocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

bool send_all(int fd, const void* p, size_t n) {  // small messages on a socket with room: all or nothing
  return send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) == ssize_t(n);
}

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// The address to listen on: iface's (IPv4 first), else host's (port 0: the kernel picks).
sockaddr_storage bind_address(const std::string& host, const std::string& iface, socklen_t* len) {
  sockaddr_storage out{};
  if (!iface.empty()) {
    net::iface_address(iface, true, &out, len);
    return out;
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), "0", &hints, &res) || !res)
    throw std::invalid_argument("liveness watch: '" + host + "' is not a numeric IP address");
  *len = res->ai_addrlen;
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return out;
}

void set_port(sockaddr_storage* sa, int port) {
  if (sa->ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(sa)->sin_port = htons(uint16_t(port));
  else reinterpret_cast<sockaddr_in6*>(sa)->sin6_port = htons(uint16_t(port));
}

// A listening socket on sa: the kernel's port (lo = 0), else the first free
// one of [lo, hi] from a random start (several Communicators share a range).
int listen_in_range(sockaddr_storage sa, socklen_t len, int lo, int hi) {
  const int n = lo ? hi - lo + 1 : 1;
  const int start = lo ? int(nonce() % uint64_t(n)) : 0;
  int err = 0;
  for (int i = 0; i < n; ++i) {
    if (lo) set_port(&sa, lo + (start + i) % n);
    const int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(errno_text("liveness watch: socket"));
    if (!bind(fd, reinterpret_cast<sockaddr*>(&sa), len) && !listen(fd, 128)) return fd;
    err = errno;
    ::close(fd);
    if (err != EADDRINUSE) break;
  }
  errno = err;
  if (lo && err == EADDRINUSE)
    throw std::runtime_error("liveness watch: every port of PZ_PORT_RANGE " + std::to_string(lo) + "-" +
                             std::to_string(hi) + " is in use on this host");
  throw std::runtime_error(errno_text("liveness watch: bind/listen"));
}

}  // namespace

// Half-open handshakes inside connect(): what each fd waits for next.
struct Watch::Pending {
  int fd;
  int peer;        // connector: the lower rank it dials; acceptor: -1 until HELLO names one
  bool dialing;    // ours (to a lower rank) or theirs (accepted)
  int stage = 0;   // dialing: 0 connecting, 1 HELLO sent; accepted: 0 reading HELLO, 1 CHALLENGE sent
  uint64_t mine = 0, theirs = 0;
  uint8_t buf[32] = {};
  size_t got = 0;
  Clock::time_point at = Clock::now();  // accepted: when (silent strangers are closed after kHandshakeS)
};

Watch::Watch(int rank, const std::vector<int64_t>& global, const std::string& secret, double silence_s,
             const std::string& host, const std::string& iface, int port_lo, int port_hi)
    : rank_(rank), world_(int(global.size())), global_(global), silence_s_(silence_s), peers_(global.size()) {
  if (secret.size() != 16) throw std::invalid_argument("liveness watch: the group secret must be 16 bytes");
  if (rank < 0 || rank >= world_) throw std::invalid_argument("liveness watch: rank out of range");
  if (!(silence_s > 0)) throw std::invalid_argument("liveness watch: the heartbeat timeout must be positive");
  if (port_lo < 0 || port_hi > 65535 || (port_lo && port_hi < port_lo) || (!port_lo && port_hi))
    throw std::invalid_argument("liveness watch: bad port range");
  std::memcpy(key_, secret.data(), 16);
  dial_.assign(global.size(), "");
  socklen_t len = 0;
  sockaddr_storage sa = bind_address(host, iface, &len);
  listen_fd_ = listen_in_range(sa, len, port_lo, port_hi);
  nonblocking(listen_fd_);
  len = sizeof sa;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
  char h[NI_MAXHOST], p[NI_MAXSERV];
  getnameinfo(reinterpret_cast<sockaddr*>(&sa), len, h, sizeof h, p, sizeof p, NI_NUMERICHOST | NI_NUMERICSERV);
  address_ = std::string(h) + " " + p;
}

Watch::~Watch() { close(); }

std::string Watch::address() const { return address_; }

std::string Watch::at(int peer) const {  // "host port" -> "host:port" ([v6]:port)
  const std::string& a = dial_[peer];
  const auto sp = a.rfind(' ');
  if (sp == std::string::npos) return a;
  const std::string h = a.substr(0, sp);
  return (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + a.substr(sp + 1);
}

std::string Watch::who(int peer) const {
  return "rank " + std::to_string(peer) + " (global " + std::to_string(global_[peer]) + ")";
}

void Watch::connect(const std::vector<std::string>& addrs, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (!connect_for(addrs, std::max(0.0, since(Clock::now(), deadline)))) {
    if (Clock::now() >= deadline) {
      std::string who_missing;
      for (int r : missing()) who_missing += (who_missing.empty() ? "" : ", ") + who(r);
      for (auto& q : pend_) ::close(q.fd);
      pend_.clear();
      for (auto& peer : peers_)
        if (peer.fd >= 0) ::close(peer.fd), peer.fd = -1;
      char t[32];
      snprintf(t, sizeof t, "%g", timeout_s);
      throw std::runtime_error("liveness watch: " + who_missing + " did not connect within " + t + " s");
    }
  }
}

std::vector<int> Watch::missing() const {
  std::vector<int> out;
  for (int r = 0; r < world_; ++r)
    if (r != rank_ && peers_[r].fd < 0) out.push_back(r);
  return out;
}

bool Watch::connect_for(const std::vector<std::string>& addrs, double slice_s) {
  if (int(addrs.size()) != world_) throw std::invalid_argument("liveness watch: one address per rank expected");
  if (thread_.joinable() || closed_) throw std::runtime_error("liveness watch: connect() runs once, before close()");
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(slice_s));
  std::vector<Pending>& pend = pend_;
  auto drop = [&](size_t i) { ::close(pend[i].fd), pend.erase(pend.begin() + long(i)); };
  auto cleanup = [&] {
    for (auto& q : pend) ::close(q.fd);
    pend.clear();
    for (auto& peer : peers_)
      if (peer.fd >= 0) ::close(peer.fd), peer.fd = -1;
  };
  for (int j = 0; j < rank_ && !dialed_; ++j) {  // dial every lower rank, on the first call
    const auto sp = addrs[j].rfind(' ');
    addrinfo hints{}, *res = nullptr;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    hints.ai_socktype = SOCK_STREAM;
    if (sp == std::string::npos ||
        getaddrinfo(addrs[j].substr(0, sp).c_str(), addrs[j].substr(sp + 1).c_str(), &hints, &res) || !res) {
      cleanup();
      throw std::invalid_argument("liveness watch: rank " + std::to_string(j) + " published a bad address");
    }
    dial_[j] = addrs[j];
    const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) nonblocking(fd);
    const int rc = fd < 0 ? -1 : ::connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (rc && (fd < 0 || errno != EINPROGRESS)) {
      const std::string e = errno_text(("liveness watch: connecting to " + who(j) + " at " + at(j)).c_str());
      if (fd >= 0) ::close(fd);
      cleanup();
      throw std::runtime_error(e);
    }
    pend.push_back({fd, j, true});
  }
  dialed_ = true;
  int left = int(missing().size());
  while (left > 0) {
    const auto now = Clock::now();
    if (now >= deadline) return false;  // a slice's end: the caller checks its peers, then calls again
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    for (auto& q : pend) fds.push_back({q.fd, short(q.dialing && q.stage == 0 ? POLLOUT : POLLIN), 0});
    const int ms = int(std::min<double>(200, since(now, deadline) * 1000 + 1));
    if (poll(fds.data(), fds.size(), ms) < 0 && errno != EINTR) {
      cleanup();
      throw std::runtime_error(errno_text("liveness watch: poll"));
    }
    const size_t polled = pend.size();  // accepted after the walk: polled next round
    // Walk back to front: drop() erases.
    for (size_t i = polled; i-- > 0;) {
      Pending& q = pend[i];
      const short rev = fds[i + 1].revents;
      if (!rev) continue;
      if (q.dialing && q.stage == 0) {
        int err = 0;
        socklen_t l = sizeof err;
        getsockopt(q.fd, SOL_SOCKET, SO_ERROR, &err, &l);
        if (err) {
          const std::string e = "liveness watch: connecting to " + who(q.peer) + " at " + at(q.peer) + ": " +
                                std::strerror(err);
          cleanup();
          throw std::runtime_error(e);
        }
        uint8_t m[kHello];
        q.mine = nonce();
        put32(m, kMagic), put32(m + 4, uint32_t(rank_)), put32(m + 8, uint32_t(q.peer)), put64(m + 12, q.mine);
        if (!send_all(q.fd, m, sizeof m)) {
          const std::string e = errno_text(("liveness watch: greeting " + who(q.peer)).c_str());
          cleanup();
          throw std::runtime_error(e);
        }
        q.stage = 1;
        continue;
      }
      const size_t want = q.dialing ? kChallenge : q.stage == 0 ? kHello : kProof;
      const ssize_t n = recv(q.fd, q.buf + q.got, want - q.got, 0);
      if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) {
        if (q.dialing) {  // the peer we dialed hung up on us: it refused our proof, or died
          const std::string e = "liveness watch: " + who(q.peer) + " closed the connection during the handshake "
                                "(a different group secret, or the process died)";
          cleanup();
          throw std::runtime_error(e);
        }
        drop(i);
        continue;
      }
      if (n < 0) continue;
      q.got += size_t(n);
      if (q.got < want) continue;
      q.got = 0;
      if (q.dialing) {  // CHALLENGE: the acceptor proves the secret over our nonce
        q.theirs = get64(q.buf);
        if (get64(q.buf + 8) != mac(key_, 'A', q.mine, q.theirs, uint32_t(rank_), uint32_t(q.peer))) {
          const std::string e = "liveness watch: the listener at " + who(q.peer) + "'s address does not know the "
                                "group's secret";
          cleanup();
          throw std::runtime_error(e);
        }
        uint8_t m[kProof];
        put64(m, mac(key_, 'C', q.theirs, q.mine, uint32_t(rank_), uint32_t(q.peer)));
        if (!send_all(q.fd, m, sizeof m)) {
          const std::string e = errno_text(("liveness watch: answering " + who(q.peer)).c_str());
          cleanup();
          throw std::runtime_error(e);
        }
        peers_[q.peer].fd = q.fd;
        pend.erase(pend.begin() + long(i));
        --left;
      } else if (q.stage == 0) {  // HELLO: a would-be higher rank names itself
        const uint32_t from = get32(q.buf + 4);
        if (get32(q.buf) != kMagic || get32(q.buf + 8) != uint32_t(rank_) || from <= uint32_t(rank_) ||
            from >= uint32_t(world_) || peers_[from].fd >= 0) {
          drop(i);
          continue;
        }
        q.peer = int(from);
        q.theirs = get64(q.buf + 12);
        q.mine = nonce();
        uint8_t m[kChallenge];
        put64(m, q.mine), put64(m + 8, mac(key_, 'A', q.theirs, q.mine, from, uint32_t(rank_)));
        if (!send_all(q.fd, m, sizeof m)) {
          drop(i);
          continue;
        }
        q.stage = 1;
      } else {  // PROOF: the connector knows the secret; only now is it a peer
        if (get64(q.buf) != mac(key_, 'C', q.mine, q.theirs, uint32_t(q.peer), uint32_t(rank_)) ||
            peers_[q.peer].fd >= 0) {
          drop(i);
          continue;
        }
        peers_[q.peer].fd = q.fd;
        pend.erase(pend.begin() + long(i));
        --left;
      }
    }
    if (fds[0].revents & POLLIN) {
      for (int fd; (fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) {
        // More unproven connections than ranks could make: someone else's. The
        // oldest goes, never the newcomer, so strangers holding connections
        // open cannot turn a real peer away.
        if (std::count_if(pend.begin(), pend.end(), [](const Pending& q) { return !q.dialing; }) >= kMaxStrangers) {
          auto oldest = std::find_if(pend.begin(), pend.end(), [](const Pending& q) { return !q.dialing; });
          ::close(oldest->fd);
          pend.erase(oldest);
        }
        nonblocking(fd);
        pend.push_back({fd, -1, false});
      }
    }
    for (size_t i = pend.size(); i-- > 0;)  // accepted but silent past the handshake's time: a stranger
      if (!pend[i].dialing && since(pend[i].at, now) > kHandshakeS) {
        ::close(pend[i].fd);
        pend.erase(pend.begin() + long(i));
      }
  }
  for (auto& q : pend) ::close(q.fd);  // strangers still mid-handshake
  ::close(listen_fd_);                 // every peer is here: nobody else may connect
  listen_fd_ = -1;
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK)) {
    cleanup();
    throw std::runtime_error(errno_text("liveness watch: pipe"));
  }
  const auto now = Clock::now();
  for (auto& p : peers_) p.heard = now;
  thread_ = std::thread([this] { run(); });
  return true;
}

bool Watch::failed(int* rank, std::string* why) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!failed_) return false;
  *rank = failed_rank_, *why = why_;
  return true;
}

std::vector<std::pair<int, std::string>> Watch::departed() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::pair<int, std::string>> out;
  for (int j = 0; j < world_; ++j)
    if (!peers_[j].gone.empty() && !peers_[j].bye) out.emplace_back(j, who(j) + " " + peers_[j].gone);
  return out;
}

void Watch::expect(const std::vector<int>& peers, int delta) {
  for (int p : peers) {
    if (p < 0 || p >= world_ || p == rank_) continue;
    if (peers_[p].expect.fetch_add(delta) == 0 && delta > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      peers_[p].expect_since = Clock::now();
    }
  }
}

void Watch::attach(std::function<void(const std::string&)> on_failure, std::function<void(int, bool)> on_gone,
                   std::function<bool()> quiet) {
  std::string why;
  std::vector<int> gone;
  {
    std::lock_guard<std::mutex> lk(mu_);
    on_failure_ = std::move(on_failure);
    on_gone_ = std::move(on_gone);
    quiet_ = std::move(quiet);
    for (int j = 0; j < world_; ++j)
      if (!peers_[j].gone.empty()) gone.push_back(j);
    if (!failed_) {
      if (on_gone_)
        for (int j : gone) on_gone_(j, peers_[j].quiet);  // gone before the attach
      return;
    }
    why = why_;
  }
  on_failure_(why);  // it failed before the attach: abort now
}

void Watch::went(int peer) {
  std::function<void(int, bool)> cb;
  bool quiet;
  {
    std::lock_guard<std::mutex> lk(mu_);
    cb = on_gone_, quiet = peers_[peer].quiet;
  }
  if (cb) cb(peer, quiet);
}

void Watch::fail(int peer, const std::string& what) {
  std::function<void(const std::string&)> cb;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) return;
    failed_ = true, failed_rank_ = peer, why_ = why = who(peer) + " " + what;
    cb = on_failure_;
  }
  // On its own thread: the engine's abort waits for its endpoints to close,
  // and the beats to the other peers must not pause meanwhile.
  if (cb) aborter_ = std::thread(std::move(cb), std::move(why));
}

void Watch::run() {
  const auto beat = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(kBeatS, silence_s_ / 4)));
  const int poll_ms = std::max(1, int(std::min(0.2, silence_s_ / 8) * 1000));
  auto next_beat = Clock::now();
  std::vector<pollfd> fds;
  std::vector<int> who_fd;
  for (;;) {
    const auto now = Clock::now();
    if (now >= next_beat) {
      for (auto& p : peers_)
        if (p.fd >= 0) send(p.fd, &kBeat, 1, MSG_NOSIGNAL | MSG_DONTWAIT);  // a full buffer: the peer is not reading
      next_beat = now + beat;
    }
    for (int j = 0; j < world_; ++j) {
      Peer& p = peers_[j];
      if (p.fd >= 0 && !p.bye && since(p.heard, now) > silence_s_) {
        char s[32];
        snprintf(s, sizeof s, "%.1f", since(p.heard, now));
        fail(j, std::string("died: silent for ") + s +
                " s with its connection open (stopped, hung or unreachable; PZ_HEARTBEAT_TIMEOUT)");
        std::lock_guard<std::mutex> g(fd_mu_);
        ::close(p.fd), p.fd = -1;
      }
      if (!p.gone.empty() && p.expect.load() > 0) {
        Clock::time_point t;
        {
          std::lock_guard<std::mutex> lk(mu_);
          t = std::max(p.gone_at, p.expect_since);
        }
        if (since(t, now) > (p.bye ? kByeGraceS : kGoneGraceS)) fail(j, p.gone);
      }
    }
    fds.assign(1, {wake_[0], POLLIN, 0});
    who_fd.assign(1, -1);
    for (int j = 0; j < world_; ++j)
      if (peers_[j].fd >= 0) fds.push_back({peers_[j].fd, POLLIN, 0}), who_fd.push_back(j);
    if (poll(fds.data(), fds.size(), poll_ms) < 0 && errno != EINTR) continue;
    if (fds[0].revents) break;  // close()
    const auto t = Clock::now();
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Peer& p = peers_[who_fd[i]];
      char b[64];
      const ssize_t n = recv(p.fd, b, sizeof b, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) {  // closed: after a goodbye an orderly exit, else the process is gone
        if (!p.bye) {
          std::lock_guard<std::mutex> lk(mu_);
          p.gone = "died: its connection closed (the process exited or was killed)", p.gone_at = t;
        }
        {
          std::lock_guard<std::mutex> g(fd_mu_);
          ::close(p.fd), p.fd = -1;
        }
        if (!p.bye) went(who_fd[i]);
        continue;
      }
      p.heard = t;
      const bool quiet = std::memchr(b, kBye, size_t(n)) != nullptr;
      if ((quiet || std::memchr(b, kByeBusy, size_t(n))) && !p.bye) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          p.bye = true, p.quiet = quiet, p.gone = "closed its Communicator while this rank still waits on it",
          p.gone_at = t;
        }
        went(who_fd[i]);
      }
    }
  }
  std::function<bool()> quiet;
  {
    std::lock_guard<std::mutex> lk(mu_);
    quiet = quiet_;
  }
  const char bye = !quiet || quiet() ? kBye : kByeBusy;
  for (auto& p : peers_)
    if (p.fd >= 0) send(p.fd, &bye, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

int Watch::peer_down_now() {
  std::lock_guard<std::mutex> g(fd_mu_);
  if (closed_) return -1;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    Peer& p = peers_[j];
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (p.bye && p.quiet) continue;  // left quietly: its tear explains itself (the engine's credit)
      if (!p.gone.empty()) return j;
    }
    if (p.fd < 0) continue;
    pollfd q{p.fd, short(POLLIN | POLLRDHUP), 0};
    if (poll(&q, 1, 0) <= 0 || !(q.revents & (POLLRDHUP | POLLHUP | POLLERR))) continue;
    char b[64];  // a hangup behind a quiet goodbye the thread has not read yet is no death
    const ssize_t n = recv(p.fd, b, sizeof b, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 && std::memchr(b, kBye, size_t(n))) continue;
    return j;
  }
  return -1;
}

void Watch::close() {
  {
    std::lock_guard<std::mutex> g(fd_mu_);
    if (closed_) return;
    closed_ = true;
  }
  if (thread_.joinable()) {
    const char c = 0;
    if (write(wake_[1], &c, 1) < 0) {}  // the pipe is empty and non-blocking: this cannot fail
    thread_.join();
  }
  if (aborter_.joinable()) aborter_.join();
  for (auto& q : pend_) ::close(q.fd);  // a connect_for() given up between slices
  pend_.clear();
  for (auto& p : peers_)
    if (p.fd >= 0) ::close(p.fd), p.fd = -1;
  for (int* fd : {&listen_fd_, &wake_[0], &wake_[1]})
    if (*fd >= 0) ::close(*fd), *fd = -1;
}

}  // namespace pz::watch
