// The decode-step ops of decode_select.h: validation, CPU kernels, and the
// eval_gpu stubs that raise (these ops run on the CPU stream only).

#include "decode_select.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "order.h"
#include "qfilters.h"
#include "validate.h"

namespace qfilters {

using detail::check_ndim;
using detail::cpu_stream;
using detail::fail;
using detail::ordered_score;
using detail::shape_str;

namespace {

constexpr const char* kOp = "qfilters.decode_select";

bool same_prefix(const mx::array& a, const mx::array& b, int n) {
  for (int i = 0; i < n; ++i) {
    if (a.shape(i) != b.shape(i)) {
      return false;
    }
  }
  return true;
}

// Copies `in` (any strides, up to 4 dimensions) into the row-contiguous `out`.
void strided_copy(const mx::array& in, mx::array& out) {
  const size_t item = in.itemsize();
  if (in.flags().row_contiguous && in.data_size() == in.size()) {
    std::memcpy(out.data<char>(), in.data<char>(), in.nbytes());
    return;
  }
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  const int pad = 4 - in.ndim();
  for (int i = 0; i < in.ndim(); ++i) {
    shape[pad + i] = in.shape(i);
    strides[pad + i] = in.strides()[i];
  }
  const char* src = in.data<char>();
  char* dst = out.data<char>();
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) {
          const int64_t at = a * strides[0] + b * strides[1] + c * strides[2] +
                             d * strides[3];
          std::memcpy(dst, src + at * item, item);
          dst += item;
        }
}

// Row r = (b, h) of a [B, H, 1, D] array with any strides, copied to `dst`.
void copy_new_row(const mx::array& a, int64_t r, char* dst) {
  const int64_t H = a.shape(1), D = a.shape(3);
  const size_t item = a.itemsize();
  const auto& st = a.strides();
  const char* src = a.data<char>() + ((r / H) * st[0] + (r % H) * st[1]) * item;
  if (st[3] == 1) {
    std::memcpy(dst, src, D * item);
  } else {
    for (int64_t j = 0; j < D; ++j) {
      std::memcpy(dst + j * item, src + j * st[3] * item, item);
    }
  }
}

// Writes the new scores and positions, then picks the victim of every (b, h)
// row. The state arrays are row-contiguous; `free` may be strided, and the new
// score of row (b, h) is ns[b * ns_b + h * ns_h].
void decode_select_kernel(const float* ns, int64_t ns_b, int64_t ns_h,
                          const mx::array& free,
                          mx::array& scores, mx::array& positions,
                          mx::array& victim, int64_t position, int n_sink,
                          const std::vector<int>& recent) {
  const int64_t B = scores.shape(0), H = scores.shape(1), S = scores.shape(2);
  float* sd = scores.data<float>();
  int64_t* pd = positions.data<int64_t>();
  const int32_t* fr = free.data<int32_t>();
  int32_t* out = victim.data<int32_t>();
  for (int64_t r = 0; r < B * H; ++r) {
    int64_t slot = fr[(r / H) * free.strides()[0] + (r % H) * free.strides()[1]];
    if (slot < 0 || slot >= S) {
      slot = S - 1;  // never produced by this op; keep memory safe
    }
    const int64_t at = r * S + slot;
    const int64_t recent_start = position + 1 - recent[r % H];
    const float s = ns[(r / H) * ns_b + (r % H) * ns_h];
    sd[at] = std::isfinite(s) ? s : -std::numeric_limits<float>::infinity();
    pd[at] = position;
    // victim: minimum of (ordered score, -position) over evictable slots
    const float* rs = sd + r * S;
    const int64_t* rp = pd + r * S;
    int64_t best = -1;
    uint32_t best_o = 0;
    int64_t best_p = 0;
    for (int64_t j = 0; j < S; ++j) {
      const int64_t p = rp[j];
      if (p < n_sink || p >= recent_start) {
        continue;
      }
      const uint32_t o = ordered_score(rs[j]);
      if (best < 0 || o < best_o || (o == best_o && p > best_p)) {
        best = j;
        best_o = o;
        best_p = p;
      }
    }
    out[r] = static_cast<int32_t>(best < 0 ? slot : best);
  }
}

} // namespace

mx::array write_slot(const mx::array& buf, const mx::array& rows,
                     const mx::array& free, mx::StreamOrDevice s) {
  constexpr const char* op = "qfilters.write_slot";
  check_ndim(op, "buf", buf, 4, "[B, H, S, D]");
  check_ndim(op, "rows", rows, 4, "[B, H, 1, D]");
  check_ndim(op, "free", free, 2, "[B, H]");
  if (!same_prefix(rows, buf, 2) || !same_prefix(free, buf, 2) ||
      rows.shape(2) != 1 || rows.shape(3) != buf.shape(3) ||
      rows.dtype() != buf.dtype()) {
    fail(op, "rows " + shape_str(rows) + " and free " + shape_str(free) +
                 " must be one row of buf " + shape_str(buf) +
                 " (same dtype) for every [B, H]");
  }
  mx::Stream stream = cpu_stream(op, s);
  if (stream.device.type != mx::Device::cpu) {
    fail(op, "runs on the CPU only");
  }
  return mx::array(buf.shape(), buf.dtype(), std::make_shared<WriteSlot>(stream),
                   {buf, rows, mx::astype(free, mx::int32, stream)});
}

void WriteSlot::eval_cpu(const std::vector<mx::array>& inputs,
                         std::vector<mx::array>& outputs) {
  const mx::array& buf = inputs[0];
  mx::array& out = outputs[0];
  const bool donated = buf.is_donatable() && buf.flags().row_contiguous &&
                       buf.data_size() == buf.size();
  if (donated) {
    out.copy_shared_buffer(buf);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  auto w = [](const mx::array& a) { return mx::array::unsafe_weak_copy(a); };
  encoder.dispatch([in = w(buf), rows = w(inputs[1]), fr = w(inputs[2]),
                    out = w(out), donated]() mutable {
    if (!donated) {
      strided_copy(in, out);
    }
    const int64_t H = out.shape(1), S = out.shape(2);
    const size_t row = out.shape(3) * out.itemsize();
    const int32_t* f = fr.data<int32_t>();
    for (int64_t r = 0; r < out.shape(0) * H; ++r) {
      int64_t slot = f[(r / H) * fr.strides()[0] + (r % H) * fr.strides()[1]];
      slot = (slot < 0 || slot >= S) ? S - 1 : slot;  // keep memory safe
      copy_new_row(rows, r, out.data<char>() + (r * S + slot) * row);
    }
  });
}

void WriteSlot::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[qfilters.write_slot] has no GPU implementation");
}

namespace {

// Checks shared by decode_select and decode_select_keys: the slot state
// (scores, positions, free) and the step's scalars. `new_rows` is new_scores
// [B, H, 1] or new_keys [B, H, 1, D].
void check_step(const char* op, const mx::array& scores,
                const mx::array& positions, const mx::array& new_rows,
                const char* new_name, const mx::array& free, int64_t position,
                int n_sink, const std::vector<int>& recent,
                std::vector<int>& per_head) {
  check_ndim(op, "scores", scores, 3, "[B, H, S]");
  check_ndim(op, "positions", positions, 3, "[B, H, S]");
  check_ndim(op, "free", free, 2, "[B, H]");
  if (!same_prefix(positions, scores, 3) || !same_prefix(new_rows, scores, 2) ||
      !same_prefix(free, scores, 2) || new_rows.shape(2) != 1) {
    fail(op, "scores " + shape_str(scores) + ", positions " +
                 shape_str(positions) + ", " + new_name + " " +
                 shape_str(new_rows) + " and free " + shape_str(free) +
                 " must be [B, H, S], [B, H, S], [B, H, 1, ...] and [B, H]");
  }
  if (scores.dtype() != mx::float32 || positions.dtype() != mx::int64) {
    fail(op, "scores must be float32 and positions int64");
  }
  per_head = detail::expand_recent(op, recent, scores.shape(1), n_sink,
                                   scores.shape(2), false, "S");
  if (position < 0) {
    fail(op, "position must be >= 0, got " + std::to_string(position));
  }
}

std::vector<mx::array> make_step(std::vector<mx::array> inputs,
                                 int64_t position, int n_sink,
                                 std::vector<int> recent, int sign,
                                 mx::Stream stream) {
  const mx::array& scores = inputs[0];
  const mx::Shape bh = {scores.shape(0), scores.shape(1)};
  const mx::Shape ss = scores.shape(), ps = inputs[1].shape();
  return mx::array::make_arrays(
      {ss, ps, bh}, {mx::float32, mx::int64, mx::int32},
      std::make_shared<DecodeSelect>(stream, position, n_sink,
                                     std::move(recent), sign),
      std::move(inputs));
}

} // namespace

std::vector<mx::array> decode_select(const mx::array& scores,
                                     const mx::array& positions,
                                     const mx::array& new_scores,
                                     const mx::array& free, int64_t position,
                                     int n_sink, const std::vector<int>& recent,
                                     mx::StreamOrDevice s) {
  check_ndim(kOp, "new_scores", new_scores, 3, "[B, H, 1]");
  std::vector<int> per_head;
  check_step(kOp, scores, positions, new_scores, "new_scores", free, position,
             n_sink, recent, per_head);
  mx::Stream stream = cpu_stream(kOp, s);
  if (stream.device.type != mx::Device::cpu) {
    fail(kOp, "runs on the CPU only; use the reference path on the GPU");
  }
  // No contiguous() nodes: the kernel reads new_scores and free with strides
  // and copies the (small) state arrays.
  return make_step({scores, positions, mx::astype(new_scores, mx::float32, stream),
                    mx::astype(free, mx::int32, stream)},
                   position, n_sink, std::move(per_head), 0, stream);
}

std::vector<mx::array> decode_select_keys(
    const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& filters, const mx::array& free,
    int64_t position, int sign, int n_sink, const std::vector<int>& recent,
    mx::StreamOrDevice s) {
  constexpr const char* op = "qfilters.decode_select_keys";
  check_score_inputs(op, new_keys, filters, sign);
  std::vector<int> per_head;
  check_step(op, scores, positions, new_keys, "new_keys", free, position,
             n_sink, recent, per_head);
  mx::Stream stream = cpu_stream(op, s);
  if (stream.device.type != mx::Device::cpu) {
    fail(op, "runs on the CPU only; use the reference path on the GPU");
  }
  return make_step({scores, positions, new_keys, mx::astype(free, mx::int32, stream),
                    mx::astype(filters, mx::float32, stream)},
                   position, n_sink, std::move(per_head), sign, stream);
}

void DecodeSelect::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  auto w = [](const mx::array& a) { return mx::array::unsafe_weak_copy(a); };
  // sign_ != 0: inputs[2] is new_keys [B, H, 1, D] and inputs[4] the filters.
  const mx::array none = inputs[0];
  encoder.dispatch([s_in = w(inputs[0]), p_in = w(inputs[1]), nw = w(inputs[2]),
                    fr = w(inputs[3]),
                    filt = w(inputs.size() > 4 ? inputs[4] : none),
                    sc = w(outputs[0]), pos = w(outputs[1]),
                    victim = w(outputs[2]), position = position_,
                    n_sink = n_sink_, recent = recent_,
                    sign = sign_]() mutable {
    strided_copy(s_in, sc);
    strided_copy(p_in, pos);
    if (sign == 0) {
      decode_select_kernel(nw.data<float>(), nw.strides()[0], nw.strides()[1],
                           fr, sc, pos, victim, position, n_sink, recent);
      return;
    }
    const int64_t H = sc.shape(1);
    std::vector<float> ns(static_cast<size_t>(sc.shape(0) * H));
    score_into(nw, filt, ns.data(), sign);
    decode_select_kernel(ns.data(), H, 1, fr, sc, pos, victim, position, n_sink,
                         recent);
  });
}

void DecodeSelect::eval_gpu(const std::vector<mx::array>&,
                            std::vector<mx::array>&) {
  throw std::runtime_error(
      "[qfilters.decode_select] has no GPU implementation; the metal backend "
      "uses reference.decode_select");
}

bool DecodeSelect::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecodeSelect&>(other);
  return position_ == o.position_ && n_sink_ == o.n_sink_ &&
         recent_ == o.recent_ && sign_ == o.sign_;
}

std::vector<mx::Shape> DecodeSelect::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape(), inputs[1].shape(),
          {inputs[0].shape(0), inputs[0].shape(1)}};
}

} // namespace qfilters
