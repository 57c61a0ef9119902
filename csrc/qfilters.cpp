// Q-Filters eviction primitives projection_scores and select_compact: ops
// (validation), CPU kernels (eval_cpu), Metal dispatch (eval_gpu; a stub that
// raises when built without Metal). See qfilters.h for the semantics;
// python/qfilters_mlx/backends/reference.py is the oracle the tests compare against.

#include "qfilters.h"
#include "validate.h"
#include "order.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#ifdef _METAL_
#include <dlfcn.h>

#include <filesystem>

#include "mlx/backend/metal/device.h"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QF_X86_DISPATCH 1
#endif

namespace qfilters {

using detail::check_ndim;
using detail::ordered_score;
using detail::cpu_stream;
using detail::fail;
using detail::shape_str;

namespace {

// ---------------------------------------------------------------------------
// Validation helpers
// ---------------------------------------------------------------------------

bool is_score_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}


// ---------------------------------------------------------------------------
// Scoring kernel
// ---------------------------------------------------------------------------

// Exact float16 -> float32 conversion written without branches so that the
// dot-product loop vectorises (mx::float16_t's own conversion is exact too,
// but its if/else keeps GCC from vectorising the loop: about 3x slower).
// Checked equal to it on all 65536 inputs.
// Normal and inf/NaN inputs: rebias the exponent by a multiply; subnormals
// and zeros: the "magic bias" subtraction (Maratyszcza, FP16 library).
inline float to_f32(float x) {
  return x;
}
inline float to_f32(mx::bfloat16_t x) {
  return static_cast<float>(x);
}
inline float to_f32(mx::float16_t x) {
#if defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC)
  return static_cast<float>(x);  // native __fp16: vectorised conversion
#else
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  uint32_t nbits = (two_w >> 4) + (0xE0u << 23);
  float normal;
  std::memcpy(&normal, &nbits, sizeof(normal));
  normal *= 0x1.0p-112f;
  uint32_t dbits = (two_w >> 17) | (126u << 23);
  float denorm;
  std::memcpy(&denorm, &dbits, sizeof(denorm));
  denorm -= 0.5f;
  uint32_t nb, db;
  std::memcpy(&nb, &normal, sizeof(nb));
  std::memcpy(&db, &denorm, sizeof(db));
  const uint32_t denormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));
  const uint32_t bits = sign | (db & denormal) | (nb & ~denormal);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// Dot product of one key row (contiguous, any float dtype) with a float32
// filter. Independent partial sums let the compiler vectorise without
// reassociating a single accumulator; they are combined pairwise.
template <typename T>
inline float dot_row(const T* x, const float* f, int D) {
  constexpr int L = 16;
  float acc[L] = {};
  int d = 0;
  for (; d + L <= D; d += L) {
    for (int j = 0; j < L; ++j) {
      acc[j] += to_f32(x[d + j]) * f[d + j];
    }
  }
  float tail = 0.0f;
  for (; d < D; ++d) {
    tail += to_f32(x[d]) * f[d];
  }
  for (int w = L / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) {
      acc[j] += acc[j + w];
    }
  }
  return acc[0] + tail;
}

#ifdef QF_X86_DISPATCH
// x86-64 with AVX2 + FMA + F16C (checked at run time): hardware float16
// conversion, 8-wide FMA. Same float32 accumulation, another summation order.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(
    const mx::float16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(
    const mx::bfloat16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void score_rows_avx2(
    const T* base, int64_t row_stride, int T_, const float* f, int D,
    float sgn, float* out) {
  for (int t = 0; t < T_; ++t) {
    const T* x = base + t * row_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 32 <= D; d += 32) {
      a0 = _mm256_fmadd_ps(load8(x + d), _mm256_loadu_ps(f + d), a0);
      a1 = _mm256_fmadd_ps(load8(x + d + 8), _mm256_loadu_ps(f + d + 8), a1);
      a2 = _mm256_fmadd_ps(load8(x + d + 16), _mm256_loadu_ps(f + d + 16), a2);
      a3 = _mm256_fmadd_ps(load8(x + d + 24), _mm256_loadu_ps(f + d + 24), a3);
    }
    for (; d + 8 <= D; d += 8) {
      a0 = _mm256_fmadd_ps(load8(x + d), _mm256_loadu_ps(f + d), a0);
    }
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float acc = _mm_cvtss_f32(h);
    for (; d < D; ++d) {
      acc += to_f32(x[d]) * f[d];
    }
    out[t] = sgn * acc;
  }
}

bool has_avx2_f16c() {
  static const bool ok = __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

template <typename T>
void score_kernel(const mx::array& keys, const mx::array& filters,
                  float* op, int sign) {
  const int B = keys.shape(0), H = keys.shape(1), T_ = keys.shape(2),
            D = keys.shape(3);
  const auto& ks = keys.strides();
  const auto& fs = filters.strides();
  const T* kp = keys.data<T>();
  const float* fp = filters.data<float>();
  const float sgn = static_cast<float>(sign);

  std::vector<float> filt(static_cast<size_t>(D));
  std::vector<T> row;  // gather buffer for keys with a strided last axis
  if (ks[3] != 1) {
    row.resize(static_cast<size_t>(D));
  }
  for (int h = 0; h < H; ++h) {
    for (int d = 0; d < D; ++d) {
      filt[d] = fp[h * fs[0] + d * fs[1]];
    }
    for (int b = 0; b < B; ++b) {
      const T* base = kp + b * ks[0] + h * ks[1];
      float* o = op + (static_cast<int64_t>(b) * H + h) * T_;
#ifdef QF_X86_DISPATCH
      if (ks[3] == 1 && has_avx2_f16c()) {
        score_rows_avx2<T>(base, ks[2], T_, filt.data(), D, sgn, o);
        continue;
      }
#endif
      if (ks[3] == 1) {
        for (int t = 0; t < T_; ++t) {
          o[t] = sgn * dot_row(base + t * ks[2], filt.data(), D);
        }
      } else {
        for (int t = 0; t < T_; ++t) {
          const T* src = base + t * ks[2];
          for (int d = 0; d < D; ++d) {
            row[d] = src[d * ks[3]];
          }
          o[t] = sgn * dot_row(row.data(), filt.data(), D);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Selection + compaction kernel
// ---------------------------------------------------------------------------


// Selection of one row: writes the kept positions, ascending, to `kept`.
// Forced: [0, lo) and [hi, T). Among the candidates [lo, hi) the n_pick
// largest (ordered score, -position) pairs are kept. Threshold + count, O(T):
// nth_element finds the n_pick-th largest ordered score v; every candidate
// above v is kept, and the earliest (n_pick - #above) candidates equal to v.
void select_row(const float* s, int64_t stride, int T, int lo, int hi,
                int n_pick, std::vector<uint32_t>& ord,
                std::vector<uint32_t>& work, int32_t* kept) {
  int n = 0;
  for (int t = 0; t < lo; ++t) {
    kept[n++] = t;
  }
  const int n_cand = hi - lo;
  if (n_pick > 0) {
    uint32_t* o = ord.data();
    const float* c = s + lo * stride;
    if (stride == 1) {
      for (int i = 0; i < n_cand; ++i) {
        o[i] = ordered_score(c[i]);
      }
    } else {
      for (int i = 0; i < n_cand; ++i) {
        o[i] = ordered_score(c[i * stride]);
      }
    }
    std::copy(o, o + n_cand, work.begin());
    auto nth = work.begin() + (n_cand - n_pick);
    std::nth_element(work.begin(), nth, work.begin() + n_cand);
    const uint32_t v = *nth;
    int above = 0;
    for (int i = 0; i < n_cand; ++i) {
      above += o[i] > v;
    }
    int ties = n_pick - above;  // equal-to-threshold slots, earliest first
    for (int i = 0; i < n_cand; ++i) {
      const uint32_t x = o[i];
      if (x > v || (x == v && ties-- > 0)) {
        kept[n++] = lo + i;
      }
    }
  }
  for (int t = hi; t < T; ++t) {
    kept[n++] = t;
  }
}

// Copy element by element when the last axis is strided.
template <size_t N>
void copy_strided_row(char* dst, const char* src, int D, int64_t stride) {
  for (int d = 0; d < D; ++d) {
    std::memcpy(dst + d * N, src + d * stride * static_cast<int64_t>(N), N);
  }
}

void copy_row(char* dst, const char* src, int D, int64_t stride,
              size_t itemsize) {
  if (stride == 1) {
    std::memcpy(dst, src, static_cast<size_t>(D) * itemsize);
    return;
  }
  switch (itemsize) {
    case 1: return copy_strided_row<1>(dst, src, D, stride);
    case 2: return copy_strided_row<2>(dst, src, D, stride);
    case 4: return copy_strided_row<4>(dst, src, D, stride);
    case 8: return copy_strided_row<8>(dst, src, D, stride);
    default:
      for (int d = 0; d < D; ++d) {
        std::memcpy(dst + d * itemsize,
                    src + d * stride * static_cast<int64_t>(itemsize),
                    itemsize);
      }
  }
}

// Gather rows kept[0..K) of row (b, h) of a [B, H, T, D] array `in` (any
// strides) into the contiguous [K, D] block at `dst`.
void gather_rows(const mx::array& in, int b, int h, const int32_t* kept, int K,
                 char* dst) {
  const int D = in.shape(3);
  const size_t isz = in.itemsize();
  const auto& st = in.strides();
  const char* base = in.data<char>() +
      (b * st[0] + h * st[1]) * static_cast<int64_t>(isz);
  const size_t row_bytes = static_cast<size_t>(D) * isz;
  for (int i = 0; i < K; ++i) {
    const char* src = base + kept[i] * st[2] * static_cast<int64_t>(isz);
    copy_row(dst + i * row_bytes, src, D, st[3], isz);
  }
}

void select_compact_kernel(const mx::array& scores, const mx::array& keys,
                           const mx::array& values, mx::array& kept_out,
                           mx::array& keys_out, mx::array& values_out,
                           int budget, int n_sink,
                           const std::vector<int>& recent) {
  const int B = scores.shape(0), H = scores.shape(1), T_ = scores.shape(2);
  const int K = std::min(budget, T_);
  const auto& ss = scores.strides();
  const float* sp = scores.data<float>();
  int32_t* kp = kept_out.data<int32_t>();
  char* ko = keys_out.data<char>();
  char* vo = values_out.data<char>();
  const size_t krow = static_cast<size_t>(keys.shape(3)) * keys.itemsize();
  const size_t vrow = static_cast<size_t>(values.shape(3)) * values.itemsize();

  // Candidates are the positions outside the forced sink/recent sets of each
  // head. n_sink + recent[h] <= budget, so when K < T the two sets are
  // disjoint. The buffers fit the head with the most candidates.
  std::vector<uint32_t> ord, work;
  if (K < T_) {
    ord.resize(static_cast<size_t>(T_));
    work.resize(static_cast<size_t>(T_));
  }

  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int64_t r = static_cast<int64_t>(b) * H + h;
      int32_t* kept = kp + r * K;
      if (K == T_) {
        for (int t = 0; t < T_; ++t) {
          kept[t] = t;
        }
      } else {
        const int rh = recent[static_cast<size_t>(h)];
        select_row(sp + b * ss[0] + h * ss[1], ss[2], T_, n_sink, T_ - rh,
                   K - n_sink - rh, ord, work, kept);
      }
      gather_rows(keys, b, h, kept, K, ko + r * K * krow);
      gather_rows(values, b, h, kept, K, vo + r * K * vrow);
    }
  }
}

} // namespace

void check_score_inputs(const char* op, const mx::array& keys,
                        const mx::array& filters, int sign) {
  check_ndim(op, "keys", keys, 4, "[B, H, T, D]");
  check_ndim(op, "filters", filters, 2, "[H, D]");
  if (!is_score_dtype(keys.dtype())) {
    std::ostringstream os;
    os << "keys must be float32, float16 or bfloat16, got " << keys.dtype();
    fail(op, os.str());
  }
  if (!mx::issubdtype(filters.dtype(), mx::floating)) {
    std::ostringstream os;
    os << "filters must be a floating-point array, got " << filters.dtype();
    fail(op, os.str());
  }
  const int H = keys.shape(1), D = keys.shape(3);
  if (filters.shape(0) != H || filters.shape(1) != D) {
    std::ostringstream os;
    os << "filters must have shape [H, D] = (" << H << ", " << D
       << ") to match keys " << shape_str(keys) << ", got "
       << shape_str(filters);
    fail(op, os.str());
  }
  if (sign != 1 && sign != -1) {
    fail(op, "sign must be +1 or -1, got " + std::to_string(sign));
  }
}

void score_into(const mx::array& keys, const mx::array& filters, float* out,
                int sign) {
  const mx::Dtype t = keys.dtype();
  if (t == mx::float32) {
    score_kernel<float>(keys, filters, out, sign);
  } else if (t == mx::float16) {
    score_kernel<mx::float16_t>(keys, filters, out, sign);
  } else if (t == mx::bfloat16) {
    score_kernel<mx::bfloat16_t>(keys, filters, out, sign);
  } else {
    throw std::runtime_error("[qfilters.projection_scores] unsupported key dtype");
  }
}

// ---------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------

mx::array projection_scores(const mx::array& keys, const mx::array& filters,
                            int sign, mx::StreamOrDevice s) {
  constexpr const char* op = "qfilters.projection_scores";
  check_score_inputs(op, keys, filters, sign);
  const int B = keys.shape(0), H = keys.shape(1), T_ = keys.shape(2);
  mx::Stream stream = cpu_stream(op, s);
  mx::array f = mx::astype(filters, mx::float32, stream);
  return mx::array(
      mx::Shape{B, H, T_}, mx::float32,
      std::make_shared<ProjectionScores>(stream, sign), {keys, f});
}

std::vector<mx::array> select_compact(const mx::array& scores,
                                      const mx::array& keys,
                                      const mx::array& values, int budget,
                                      int n_sink,
                                      const std::vector<int>& recent,
                                      mx::StreamOrDevice s) {
  constexpr const char* op = "qfilters.select_compact";
  check_ndim(op, "scores", scores, 3, "[B, H, T]");
  check_ndim(op, "keys", keys, 4, "[B, H, T, D]");
  check_ndim(op, "values", values, 4, "[B, H, T, D]");
  if (!mx::issubdtype(scores.dtype(), mx::floating)) {
    std::ostringstream os;
    os << "scores must be a floating-point array, got " << scores.dtype();
    fail(op, os.str());
  }
  for (int i = 0; i < 3; ++i) {
    if (keys.shape(i) != scores.shape(i) ||
        values.shape(i) != scores.shape(i)) {
      fail(op, "keys " + shape_str(keys) + " and values " +
                   shape_str(values) +
                   " must match scores [B, H, T] = " + shape_str(scores) +
                   " in their first three dimensions");
    }
  }
  if (budget < 1) {
    fail(op, "budget must be >= 1, got " + std::to_string(budget));
  }
  std::vector<int> per_head = detail::expand_recent(
      op, recent, scores.shape(1), n_sink, budget, true, "budget");
  mx::Stream stream = cpu_stream(op, s);
  const int B = scores.shape(0), H = scores.shape(1), T_ = scores.shape(2);
  const int K = std::min(budget, T_);
  mx::array sc = mx::astype(scores, mx::float32, stream);
  return mx::array::make_arrays(
      {mx::Shape{B, H, K}, mx::Shape{B, H, K, keys.shape(3)},
       mx::Shape{B, H, K, values.shape(3)}},
      {mx::int32, keys.dtype(), values.dtype()},
      std::make_shared<SelectCompact>(stream, budget, n_sink,
                                      std::move(per_head)),
      {sc, keys, values});
}

// ---------------------------------------------------------------------------
// Primitives: CPU
// ---------------------------------------------------------------------------

void ProjectionScores::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  const mx::array& keys = inputs[0];
  const mx::array& filters = inputs[1];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(keys);
  encoder.set_input_array(filters);
  encoder.set_output_array(out);
  // Weak copies (no graph) keep shapes, strides and data pointers; the CPU
  // evaluator keeps the buffers alive until the task has run.
  encoder.dispatch([keys = mx::array::unsafe_weak_copy(keys),
                    filters = mx::array::unsafe_weak_copy(filters),
                    out = mx::array::unsafe_weak_copy(out),
                    sign = sign_]() mutable {
    score_into(keys, filters, out.data<float>(), sign);
  });
}

void SelectCompact::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  const mx::array& scores = inputs[0];
  const mx::array& keys = inputs[1];
  const mx::array& values = inputs[2];
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(scores);
  encoder.set_input_array(keys);
  encoder.set_input_array(values);
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  encoder.dispatch([scores = mx::array::unsafe_weak_copy(scores),
                    keys = mx::array::unsafe_weak_copy(keys),
                    values = mx::array::unsafe_weak_copy(values),
                    kept = mx::array::unsafe_weak_copy(outputs[0]),
                    keys_out = mx::array::unsafe_weak_copy(outputs[1]),
                    values_out = mx::array::unsafe_weak_copy(outputs[2]),
                    budget = budget_, n_sink = n_sink_,
                    recent = recent_]() mutable {
    select_compact_kernel(scores, keys, values, kept, keys_out, values_out,
                          budget, n_sink, recent);
  });
}

// ---------------------------------------------------------------------------
// Primitives: GPU (Metal builds only). The kernels are metal/qfilters.metal,
// compiled into qfilters.metallib next to this module; buffer indices match
// the signatures there, launch geometry matches
// python/qfilters_mlx/backends/metal.py (grid counts threads; whole
// threadgroups).
// ---------------------------------------------------------------------------

#ifdef _METAL_

namespace {

constexpr int kSimd = 32;
constexpr int kScoreTg = 256;
constexpr int kGatherTg = 256;
constexpr int kSelectMaxTg = 512;
constexpr int kMaxScoreGroups = 2048;
constexpr int kMaxGatherGroups = 4096;

// Folder of this shared object: qfilters.metallib is installed beside it.
std::string binary_dir() {
  static std::string dir = []() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&binary_dir), &info)) {
      throw std::runtime_error("[qfilters] cannot locate the extension module");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

MTL::ComputePipelineState* get_kernel(mx::metal::Device& d,
                                      const std::string& name) {
  auto* lib = d.get_library("qfilters", binary_dir());
  return d.get_kernel(name, lib);
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

void check_index_range(const char* op, const mx::array& a) {
  if (a.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument(
        std::string("[") + op +
        "] arrays beyond 2^31 elements are not supported on the GPU");
  }
}

const char* storage_name(size_t itemsize) {
  switch (itemsize) {
    case 1: return "uint8";
    case 2: return "uint16";
    case 4: return "uint32";
    case 8: return "uint64";
    default:
      throw std::invalid_argument(
          "[qfilters.select_compact] unsupported element size on the GPU");
  }
}

void dispatch_gather(mx::metal::Device& d, mx::metal::CommandEncoder& enc,
                     const mx::array& src, const mx::array& kept,
                     mx::array& out) {
  if (out.size() == 0) {
    return;
  }
  auto* kernel = get_kernel(
      d, std::string("qfilters_gather_") + storage_name(src.itemsize()));
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(src, 0);
  enc.set_vector_bytes(src.shape(), 1);
  enc.set_vector_bytes(src.strides(), 2);
  enc.set_input_array(kept, 3);
  enc.set_vector_bytes(kept.shape(), 4);
  enc.set_output_array(out, 5);
  const int64_t groups = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(out.size(), kGatherTg), kMaxGatherGroups));
  enc.dispatch_threads(MTL::Size(groups * kGatherTg, 1, 1),
                       MTL::Size(kGatherTg, 1, 1));
}

} // namespace

void ProjectionScores::eval_gpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  const mx::array& keys = inputs[0];
  const mx::array& filters = inputs[1];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  check_index_range("qfilters.projection_scores", keys);
  const char* dt = keys.dtype() == mx::float32
      ? "float32"
      : (keys.dtype() == mx::float16 ? "float16" : "bfloat16");
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto* kernel = get_kernel(d, std::string("qfilters_score_") + dt);
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel);
  enc.set_input_array(keys, 0);
  enc.set_vector_bytes(keys.shape(), 1);
  enc.set_vector_bytes(keys.strides(), 2);
  enc.set_input_array(filters, 3);
  enc.set_vector_bytes(filters.strides(), 4);
  enc.set_bytes(sign_, 5);
  enc.set_output_array(out, 6);
  const int64_t rows = static_cast<int64_t>(out.size());
  const int64_t groups = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(rows, kScoreTg / kSimd), kMaxScoreGroups));
  enc.dispatch_threads(MTL::Size(groups * kScoreTg, 1, 1),
                       MTL::Size(kScoreTg, 1, 1));
}

void SelectCompact::eval_gpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  const mx::array& scores = inputs[0];
  const mx::array& keys = inputs[1];
  const mx::array& values = inputs[2];
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  mx::array& kept = outputs[0];
  if (kept.size() == 0) {
    return;
  }
  check_index_range("qfilters.select_compact", keys);
  check_index_range("qfilters.select_compact", values);
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  auto& enc = mx::metal::get_command_encoder(s);

  // 1. Selection: one threadgroup per (batch, head) row.
  const int B = scores.shape(0), H = scores.shape(1), T_ = scores.shape(2);
  const int tg = static_cast<int>(std::min<int64_t>(
      kSelectMaxTg, std::max<int64_t>(kSimd, ceil_div(T_, kSimd) * kSimd)));
  auto* select = get_kernel(d, "qfilters_select");
  enc.set_compute_pipeline_state(select);
  enc.set_input_array(scores, 0);
  enc.set_vector_bytes(scores.shape(), 1);
  enc.set_vector_bytes(scores.strides(), 2);
  // params = {budget, n_sink, recent[0], ..., recent[H - 1]}
  std::vector<int> params{budget_, n_sink_};
  params.insert(params.end(), recent_.begin(), recent_.end());
  enc.set_vector_bytes(params, 3);
  enc.set_output_array(kept, 4);
  enc.dispatch_threads(
      MTL::Size(static_cast<int64_t>(tg) * B * H, 1, 1), MTL::Size(tg, 1, 1));

  // 2. Bit-exact gathers (the encoder orders them after the selection,
  //    whose output they read).
  dispatch_gather(d, enc, keys, kept, outputs[1]);
  dispatch_gather(d, enc, values, kept, outputs[2]);
}

std::optional<std::string> metal_library_path() {
  const auto p = std::filesystem::path(binary_dir()) / "qfilters.metallib";
  if (std::filesystem::exists(p)) {
    return p.string();
  }
  return std::nullopt;
}

#else

void ProjectionScores::eval_gpu(const std::vector<mx::array>&,
                                std::vector<mx::array>&) {
  throw std::runtime_error(
      "[qfilters.projection_scores] no GPU implementation: this extension was "
      "built without Metal; use the CPU stream");
}

void SelectCompact::eval_gpu(const std::vector<mx::array>&,
                             std::vector<mx::array>&) {
  throw std::runtime_error(
      "[qfilters.select_compact] no GPU implementation: this extension was "
      "built without Metal; use the CPU stream");
}

std::optional<std::string> metal_library_path() {
  return std::nullopt;
}

#endif

// ---------------------------------------------------------------------------
// Primitives: graph helpers
// ---------------------------------------------------------------------------

bool ProjectionScores::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const ProjectionScores*>(&other);
  return o != nullptr && o->sign_ == sign_;
}

std::vector<mx::Shape> ProjectionScores::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto& k = inputs[0];
  return {mx::Shape{k.shape(0), k.shape(1), k.shape(2)}};
}

bool SelectCompact::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const SelectCompact*>(&other);
  return o != nullptr && o->budget_ == budget_ && o->n_sink_ == n_sink_ &&
      o->recent_ == recent_;
}

std::vector<mx::Shape> SelectCompact::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto& s = inputs[0];
  const int K = std::min(budget_, s.shape(2));
  return {mx::Shape{s.shape(0), s.shape(1), K},
          mx::Shape{s.shape(0), s.shape(1), K, inputs[1].shape(3)},
          mx::Shape{s.shape(0), s.shape(1), K, inputs[2].shape(3)}};
}

} // namespace qfilters
