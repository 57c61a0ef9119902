// Input validation shared by the ops: errors are std::invalid_argument
// (ValueError in Python) prefixed with the op name, e.g. "[qfilters.x] ...".
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace qfilters::detail {

namespace mx = mlx::core;

std::string shape_str(const mx::array& a);

[[noreturn]] void fail(const char* op, const std::string& msg);

void check_ndim(const char* op, const char* name, const mx::array& a, int ndim,
                const char* layout);

// The stream an op runs on: the CPU's default stream unless a stream is given;
// a GPU stream only in Metal builds.
mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s);

} // namespace qfilters::detail
