// A network interface's address by name (PZ_FABRIC_IFACE): the one lookup the
// fabric engine and the liveness watch both bind with.
#pragma once
#include <sys/socket.h>

#include <string>
#include <utility>
#include <vector>

namespace pz::net {

// iface's IPv4 address, else (v6_ok) its IPv6 one, in *out (*len its size).
// Throws std::invalid_argument naming PZ_FABRIC_IFACE: no such interface
// (listing this host's), or none with an address of a usable family.
void iface_address(const std::string& iface, bool v6_ok, sockaddr_storage* out, socklen_t* len);

// Every (interface, numeric address) of this host, IPv4 and IPv6, in the
// kernel's order: the Python side picks where to listen from these.
std::vector<std::pair<std::string, std::string>> interfaces();

// The numeric host of an IPv4 or IPv6 address ("10.0.0.2", "fe80::1").
std::string numeric_host(const sockaddr_storage& sa);

}  // namespace pz::net
