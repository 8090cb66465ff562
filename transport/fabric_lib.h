// libfabric, loaded at run time: a build with the headers still imports on a
// host without the library, and only transport="fabric" needs it. Only the
// library's exported entry points are bound here; everything else in the
// libfabric API is an inline call through the objects' ops tables.
#pragma once
#include <rdma/fabric.h>

#include <string>

namespace pz::fabric {

// getinfo and open_fabric (where providers load lazily) and the load itself
// put back any signal disposition the library changes (fabric_lib.cpp).
struct Lib {
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*, struct fi_info**) = nullptr;
  void (*freeinfo)(struct fi_info*) = nullptr;
  struct fi_info* (*dupinfo)(const struct fi_info*) = nullptr;
  int (*open_fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*) = nullptr;
  const char* (*strerror)(int) = nullptr;
  uint32_t (*version)() = nullptr;
  std::string path;  // the file that was loaded
};

// The loaded library, or an exception naming what is missing and how to get it.
const Lib& lib();
// The same, as text: "" when loaded, else why not (never throws).
std::string load_error();
std::string err_text(int rc);  // fi_strerror of a (negative) return code
// How many connections libfabric's rxm has torn down (a peer closed or died)
// inside this thread's calls so far: compare around a call (fabric_lib.cpp).
uint64_t conn_closes_here();

}  // namespace pz::fabric
