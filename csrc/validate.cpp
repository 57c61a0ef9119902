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

} // namespace qfilters::detail
