// Input validation shared by the ops: errors are std::invalid_argument
// (ValueError in Python) prefixed with the op name, e.g. "[qfilters.x] ...".
#pragma once

#include <string>
#include <vector>

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

// Per-head recent windows: `recent` holds one window for every head (size 1)
// or one per head (size H). Returns H windows, each checked >= 0 and with
// n_sink + window <= limit (limit_inclusive) or < limit (otherwise); the
// message names the offending head.
std::vector<int> expand_recent(const char* op, const std::vector<int>& recent,
                               int64_t H, int n_sink, int64_t limit,
                               bool limit_inclusive, const char* limit_name);

} // namespace qfilters::detail
