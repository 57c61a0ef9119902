// The bookkeeping of one decode step of the slot-based eviction cache: the ops
// decode_select, decode_select_keys and write_slot (CPU kernels only; their
// eval_gpu raises). Implemented in decode_select.cpp.
//
//   decode_select(scores [B,H,S] f32, positions [B,H,S] int64,
//                 new_scores [B,H,1], free [B,H] int32, position, n_sink, recent)
//     (recent: one window for every head, or H windows, one per head)
//     -> scores', positions' (slot free[b,h] now holds the new token: its
//        score, non-finite stored as -inf, and `position`), victim [B,H] int32.
//
// victim is the slot to free next: among slots whose position is neither a
// sink (< n_sink) nor in its head's recent window (>= position + 1 -
// recent[h]), the
// lowest score, and among equal scores the latest position (NaN lowest,
// -0.0 == +0.0): exactly what
// qfilters_mlx.backends.reference.decode_select computes. The K/V rows
// are written by write_slot (single output, so MLX lets it reuse the buffer;
// a multi-output primitive's inputs are never donatable).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace qfilters {

namespace mx = mlx::core;

std::vector<mx::array> decode_select(
    const mx::array& scores,
    const mx::array& positions,
    const mx::array& new_scores,
    const mx::array& free,
    int64_t position,
    int n_sink,
    const std::vector<int>& recent,
    mx::StreamOrDevice s = {});

// decode_select_keys: the same step with the new token's score computed in
// the op from its key, sign * <new_keys[b,h], filters[h]> (the loop of
// projection_scores, so bit-identical to projection_scores + decode_select):
// one primitive per layer and decode step instead of two.
std::vector<mx::array> decode_select_keys(
    const mx::array& scores,
    const mx::array& positions,
    const mx::array& new_keys,
    const mx::array& filters,
    const mx::array& free,
    int64_t position,
    int sign,
    int n_sink,
    const std::vector<int>& recent,
    mx::StreamOrDevice s = {});

// write_slot(buf [B,H,S,D], rows [B,H,1,D], free [B,H] int32) -> buf with row
// free[b,h] replaced by rows[b,h]. A single-output primitive, so it takes over
// buf's memory when nothing else holds it: a decode step then moves one row.
mx::array write_slot(const mx::array& buf, const mx::array& rows,
                     const mx::array& free, mx::StreamOrDevice s = {});

class WriteSlot : public mx::Primitive {
 public:
  explicit WriteSlot(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QFiltersWriteSlot";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

class DecodeSelect : public mx::Primitive {
 public:
  // sign == 0: inputs are (scores, positions, new_scores, free); sign = +-1:
  // (scores, positions, new_keys, free, filters), the score computed here.
  // recent: one window per head (H values).
  DecodeSelect(mx::Stream stream, int64_t position, int n_sink,
               std::vector<int> recent, int sign = 0)
      : mx::Primitive(stream),
        position_(position),
        n_sink_(n_sink),
        recent_(std::move(recent)),
        sign_(sign) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QFiltersDecodeSelect";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int64_t position_;
  int n_sink_;
  std::vector<int> recent_;
  int sign_;
};

} // namespace qfilters
