// Python bindings of the Q-Filters primitives: module qfilters_mlx._ext.
// NB_DOMAIN mlx (set in CMake) shares nanobind's type registry with mlx.core,
// so mx.array and streams pass in both directions.

#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "decode_select.h"
#include "qfilters.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// `recent` from Python: one int for every head, or a sequence of H ints (one
// window per head); the ops check the count against H.
using RecentArg = std::variant<int, std::vector<int>>;

std::vector<int> recent_list(const RecentArg& r) {
  if (std::holds_alternative<int>(r)) {
    return {std::get<int>(r)};
  }
  return std::get<std::vector<int>>(r);
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() =
      "Q-Filters eviction kernels for MLX (primitives with CPU kernels; "
      "projection_scores and select_compact also run on Metal). Semantics "
      "equal qfilters_mlx.backends.reference; errors are ValueError prefixed with the op "
      "name.";

  m.def(
      "projection_scores",
      &qfilters::projection_scores,
      "keys"_a,
      "filters"_a,
      "sign"_a = 1,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Q-Filters scores ``sign * <k, u_h>`` accumulated in float32.

Args:
    keys (array): ``[B, H, T, D]`` float32, float16 or bfloat16, any strides.
    filters (array): ``[H, D]`` (converted to float32).
    sign (int): ``+1`` or ``-1``.
    stream: a CPU stream or device; default the CPU's default stream.

Returns:
    array: ``[B, H, T]`` float32.)");

  m.def(
      "metal_library_path",
      &qfilters::metal_library_path,
      R"(Path of ``qfilters.metallib`` when this extension was built with Metal
and the library is installed next to it (the ops then also run on GPU
streams), else ``None``.)");

  m.def(
      "select_compact",
      [](const mlx::core::array& scores,
         const mlx::core::array& keys,
         const mlx::core::array& values,
         int budget,
         int n_sink,
         const RecentArg& recent,
         mlx::core::StreamOrDevice s) {
        auto out = qfilters::select_compact(
            scores, keys, values, budget, n_sink, recent_list(recent), s);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      "scores"_a,
      "keys"_a,
      "values"_a,
      "budget"_a,
      "n_sink"_a = 0,
      "recent"_a = 0,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Sink/recent-masked top-k selection and compaction.

Keeps the first ``n_sink`` and last ``recent`` positions (per head when
``recent`` is a sequence of ``H`` ints) and fills the rest of ``budget`` with
the highest scores (ties: earlier position; NaN lowest).

Args:
    scores (array): ``[B, H, T]`` (converted to float32).
    keys (array): ``[B, H, T, Dk]``; values (array): ``[B, H, T, Dv]``.
    budget (int): ``>= 1``; n_sink (int), recent (int or ``H`` ints): ``>= 0``,
        ``n_sink + recent[h] <= budget``.
    stream: a CPU stream or device; default the CPU's default stream.

Returns:
    tuple: ``(kept [B, H, K] int32 ascending, keys [B, H, K, Dk],
    values [B, H, K, Dv])`` with ``K = min(budget, T)``, bit-exact rows.)");

  m.def(
      "write_slot",
      &qfilters::write_slot,
      "buf"_a,
      "rows"_a,
      "free"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(``buf [B, H, S, D]`` with row ``free[b, h]`` replaced by ``rows [B, H, 1, D]``.

Reuses ``buf``'s memory when nothing else holds it (see reference.write_slot).)");

  m.def(
      "decode_select",
      [](const mlx::core::array& scores, const mlx::core::array& positions,
         const mlx::core::array& new_scores, const mlx::core::array& free,
         int64_t position, int n_sink, const RecentArg& recent,
         mlx::core::StreamOrDevice s) {
        auto o = qfilters::decode_select(scores, positions, new_scores, free,
                                         position, n_sink, recent_list(recent),
                                         s);
        return std::make_tuple(o[0], o[1], o[2]);
      },
      "scores"_a,
      "positions"_a,
      "new_scores"_a,
      "free"_a,
      "position"_a,
      "n_sink"_a,
      "recent"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Decode-step bookkeeping of the slot cache (see reference.decode_select).

Records the new token's score and position in slot ``free[b, h]`` and returns
``(scores, positions, victim)``; ``victim [B, H]`` is the slot to free next.
``recent``: one int, or ``H`` ints (head ``h``'s window).)");

  m.def(
      "decode_select_keys",
      [](const mlx::core::array& scores, const mlx::core::array& positions,
         const mlx::core::array& new_keys, const mlx::core::array& filters,
         const mlx::core::array& free, int64_t position, int sign, int n_sink,
         const RecentArg& recent, mlx::core::StreamOrDevice s) {
        auto o = qfilters::decode_select_keys(scores, positions, new_keys,
                                              filters, free, position, sign,
                                              n_sink, recent_list(recent), s);
        return std::make_tuple(o[0], o[1], o[2]);
      },
      "scores"_a,
      "positions"_a,
      "new_keys"_a,
      "filters"_a,
      "free"_a,
      "position"_a,
      "sign"_a,
      "n_sink"_a,
      "recent"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(``decode_select`` with the new token's score computed from its key.

Equals ``decode_select(scores, positions, projection_scores(new_keys, filters,
sign), free, position, n_sink, recent)`` bit for bit (same scoring loop) in one
primitive. ``new_keys [B, H, 1, D]``, ``filters [H, D]``, ``sign`` +1 or -1.)");
}
