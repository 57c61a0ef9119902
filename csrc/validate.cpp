// Input validation shared by the ops (declared in validate.h).

#include "validate.h"

#include <sstream>
#include <stdexcept>

namespace qfilters::detail {

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < a.ndim(); ++i) {
    os << (i ? ", " : "") << a.shape(i);
  }
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

void check_ndim(const char* op, const char* name, const mx::array& a, int ndim,
                const char* layout) {
  if (a.ndim() != ndim) {
    std::ostringstream os;
    os << name << " must have " << ndim << " dimensions " << layout
       << ", got shape " << shape_str(a);
    fail(op, os.str());
  }
}

// With no stream given the kernels run on the CPU's default stream even when
// the default device is a GPU (Apple silicon memory is unified, so MLX orders
// the cross-stream dependency itself). A GPU stream is accepted only when the
// extension was built with Metal (eval_gpu dispatches metal/qfilters.metal).
mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s, mx::Device::cpu);
#ifdef _METAL_
  if (stream.device.type == mx::Device::gpu) {
    return stream;
  }
#endif
  if (stream.device.type != mx::Device::cpu) {
    fail(op,
         "the compiled kernels run on the CPU only (this extension has no GPU "
         "implementation); pass stream=mx.cpu or use the metal backend");
  }
  return stream;
}

std::vector<int> expand_recent(const char* op, const std::vector<int>& recent,
                               int64_t H, int n_sink, int64_t limit,
                               bool limit_inclusive, const char* limit_name) {
  if (recent.size() != 1 && static_cast<int64_t>(recent.size()) != H) {
    fail(op, "recent must be one int or one window per head (" +
                 std::to_string(H) + "), got " +
                 std::to_string(recent.size()) + " values");
  }
  std::vector<int> out(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) {
    const int r = recent.size() == 1 ? recent[0] : recent[h];
    const int64_t total = static_cast<int64_t>(n_sink) + r;
    if (r < 0 || n_sink < 0 ||
        (limit_inclusive ? total > limit : total >= limit)) {
      fail(op, std::string("need n_sink >= 0, recent >= 0 and n_sink + recent ") +
                   (limit_inclusive ? "<= " : "< ") + limit_name + " (" +
                   std::to_string(limit) + "), got n_sink=" +
                   std::to_string(n_sink) + ", recent=" + std::to_string(r) +
                   " (head " + std::to_string(h) + ")");
    }
    out[static_cast<size_t>(h)] = r;
  }
  return out;
}

} // namespace qfilters::detail
