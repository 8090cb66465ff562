#include "iface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace pz::net {

void iface_address(const std::string& iface, bool v6_ok, sockaddr_storage* out, socklen_t* len) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all)) throw std::runtime_error(std::string("PZ_FABRIC_IFACE: getifaddrs: ") + std::strerror(errno));
  const ifaddrs* pick = nullptr;
  bool seen = false;
  std::string names;
  for (const ifaddrs* a = all; a; a = a->ifa_next) {
    if (!a->ifa_name) continue;
    if (names.find(std::string(" ") + a->ifa_name + ",") == std::string::npos) names += std::string(" ") + a->ifa_name + ",";
    if (iface != a->ifa_name) continue;
    seen = true;
    const int fam = a->ifa_addr ? a->ifa_addr->sa_family : AF_UNSPEC;
    if (fam != AF_INET && !(v6_ok && fam == AF_INET6)) continue;
    if (!pick || (pick->ifa_addr->sa_family == AF_INET6 && fam == AF_INET)) pick = a;  // IPv4 first
  }
  if (pick) {
    *len = pick->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memset(out, 0, sizeof *out);
    std::memcpy(out, pick->ifa_addr, *len);
  }
  freeifaddrs(all);
  if (pick) return;
  if (!names.empty()) names.pop_back();
  if (seen)
    throw std::invalid_argument("PZ_FABRIC_IFACE='" + iface + "': the interface has no " +
                                (v6_ok ? "IP" : "IPv4") + " address");
  throw std::invalid_argument("PZ_FABRIC_IFACE='" + iface + "': no such network interface on this host (it has:" +
                              names + ")");
}

std::vector<std::pair<std::string, std::string>> interfaces() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all)) throw std::runtime_error(std::string("getifaddrs: ") + std::strerror(errno));
  std::vector<std::pair<std::string, std::string>> out;
  for (const ifaddrs* a = all; a; a = a->ifa_next) {
    if (!a->ifa_name || !a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6))
      continue;
    sockaddr_storage sa{};
    std::memcpy(&sa, a->ifa_addr, a->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    out.emplace_back(a->ifa_name, numeric_host(sa));
  }
  freeifaddrs(all);
  return out;
}

std::string numeric_host(const sockaddr_storage& sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* a = sa.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in&>(sa).sin_addr)
                                          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6&>(sa).sin6_addr);
  return inet_ntop(sa.ss_family, a, buf, sizeof buf) ? buf : "";
}

}  // namespace pz::net
