// Q-Filters eviction hot path as MLX custom primitives.
//
// Two ops, each an mx::Primitive: eval_cpu runs the loops of qfilters.cpp through
// MLX's CPU command encoder; eval_gpu runs metal/qfilters.metal when the
// extension is built with Metal (otherwise it raises). Their semantics are
// those of python/qfilters_mlx/backends/reference.py (the oracle; this code
// shares nothing with it):
//
//   projection_scores(keys [B,H,T,D] f32|f16|bf16, filters [H,D], sign)
//       -> scores [B,H,T] float32, sign * <k, u_h> accumulated in float32.
//   select_compact(scores [B,H,T], keys [B,H,T,Dk], values [B,H,T,Dv],
//                  budget, n_sink, recent)   (recent: 1 window or H, per head)
//       -> kept [B,H,K] int32 ascending, keys [B,H,K,Dk], values [B,H,K,Dv],
//          K = min(budget, T); kept rows are bit-exact copies.
//
// Selection rule (must equal reference.select_keep): the first n_sink and the
// last `recent[h]` positions (head h's window) are always kept; the other budget - n_sink - recent
// slots go to the highest scores; among equal scores the earlier position
// wins; NaN ranks with -inf (lowest); -0.0 equals +0.0. If budget >= T every
// position is kept.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace qfilters {

namespace mx = mlx::core;

// Ops: validate inputs (errors are std::invalid_argument, prefixed with the
// op name), then build the primitive. Inputs may have any strides.
mx::array projection_scores(
    const mx::array& keys,
    const mx::array& filters,
    int sign,
    mx::StreamOrDevice s = {});

std::vector<mx::array> select_compact(
    const mx::array& scores,
    const mx::array& keys,
    const mx::array& values,
    int budget,
    int n_sink,
    const std::vector<int>& recent,
    mx::StreamOrDevice s = {});

// Shared with decode_select_keys: the projection_scores input checks, and the
// CPU scoring loop writing sign * <k, u_h> for keys [B,H,T,D] (any strides,
// float32|float16|bfloat16) and float32 filters [H,D] to a contiguous
// [B,H,T] float32 buffer.
void check_score_inputs(const char* op, const mx::array& keys,
                        const mx::array& filters, int sign);
void score_into(const mx::array& keys, const mx::array& filters, float* out,
                int sign);

// Path of qfilters.metallib when this extension was built with Metal and the
// library is installed next to it (then the ops accept GPU streams and
// eval_gpu runs metal/qfilters.metal); otherwise nullopt.
std::optional<std::string> metal_library_path();

class ProjectionScores : public mx::Primitive {
 public:
  ProjectionScores(mx::Stream stream, int sign)
      : mx::Primitive(stream), sign_(sign) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QFiltersProjectionScores";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int sign_;
};

class SelectCompact : public mx::Primitive {
 public:
  // recent: one window per head (H values).
  SelectCompact(mx::Stream stream, int budget, int n_sink,
                std::vector<int> recent)
      : mx::Primitive(stream),
        budget_(budget),
        n_sink_(n_sink),
        recent_(std::move(recent)) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QFiltersSelectCompact";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int budget_;
  int n_sink_;
  std::vector<int> recent_;
};

} // namespace qfilters
