// Prints transport/keyed.h's outputs for tests/test_keyed.py to check against
// its own SipHash-2-4: argv[1] a key (32 hex digits), argv[2] a tweak. Lines:
// "sip N HEX" for the messages 00 01 .. N-1 (N = 0..63), then "perm X HEX"
// for a few inputs. Exits 1 when the permutation's inverse does not undo it.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "keyed.h"

// The Feistel network run backwards: what makes permute64 a bijection.
static uint64_t unpermute(const uint8_t key[16], uint32_t tweak, uint64_t y) {
  uint32_t left = static_cast<uint32_t>(y >> 32), right = static_cast<uint32_t>(y);
  for (int r = 3; r >= 0; --r) {
    const uint8_t msg[9] = {uint8_t(tweak),      uint8_t(tweak >> 8), uint8_t(tweak >> 16),
                            uint8_t(tweak >> 24), uint8_t(r),          uint8_t(left),
                            uint8_t(left >> 8),   uint8_t(left >> 16), uint8_t(left >> 24)};
    const uint32_t f = static_cast<uint32_t>(pz::keyed::siphash24(key, msg, sizeof msg));
    const uint32_t prev = right ^ f;
    right = left, left = prev;
  }
  return (static_cast<uint64_t>(left) << 32) | right;
}

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]).size() != 32) return std::fprintf(stderr, "usage: check_keyed KEYHEX TWEAK\n"), 2;
  uint8_t key[16], msg[64];
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(std::stoul(std::string(argv[1] + 2 * i, 2), nullptr, 16));
  const uint32_t tweak = static_cast<uint32_t>(std::stoul(argv[2]));
  for (int i = 0; i < 64; ++i) msg[i] = static_cast<uint8_t>(i);
  for (size_t n = 0; n < 64; ++n) std::printf("sip %zu %016llx\n", n, (unsigned long long)pz::keyed::siphash24(key, msg, n));
  int bad = 0;
  uint64_t x = 0;
  for (int i = 0; i < 100000; ++i, x = x * 6364136223846793005ull + 1442695040888963407ull) {
    const uint64_t y = pz::keyed::permute64(key, tweak, x);
    if (unpermute(key, tweak, y) != x) ++bad;
    if (i < 8) std::printf("perm %llu %016llx\n", (unsigned long long)x, (unsigned long long)y);
  }
  std::printf("%d failures\n", bad);
  return bad != 0;
}
