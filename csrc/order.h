// The score order shared by the selection kernels (must equal
// python/qfilters_mlx/backends/reference.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace qfilters::detail {

// An order-preserving map of a float32 score to uint32: negative values are
// bit-inverted, the others get the sign bit set. NaN is mapped to -inf first
// and -0.0 to +0.0, as in the reference (NaN ranks lowest, -0.0 == +0.0).
// Branch-free so that the loops filling the key buffers vectorise.
inline uint32_t ordered_score(float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof(bits));
  bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0xFF800000u : bits;
  bits = bits == 0x80000000u ? 0u : bits;
  const uint32_t neg = 0u - (bits >> 31);
  return bits ^ (neg | 0x80000000u);
}

} // namespace qfilters::detail
