// Q-Filters Metal kernels for the metallib (built by mlx_build_metallib when
// MLX_BUILD_METAL is on; loaded by ProjectionScores / SelectCompact::eval_gpu
// in csrc/qfilters.cpp). Kernel names are built on the host as
// qfilters_<op>_<dtype>. The signatures list their buffers in the order MLX's
// mx.fast.metal_kernel generates for the JIT path (python/qfilters_mlx/
// backends/metal.py), and the bodies are the same QF_*_BODY lines, so both
// entry points run the same code. Buffer indices must match eval_gpu.

#include "metal/qfilters.h"

// Explicit instantiation under a host name (as mlx's instantiate_kernel).
#define QF_INSTANTIATE(host, func, ...)                              \
  template [[host_name(host)]] [[kernel]] decltype(func<__VA_ARGS__>) \
      func<__VA_ARGS__>;

template <typename L, typename KT>
[[kernel]] void qfilters_score(
    const device KT* keys [[buffer(0)]],
    const constant int* keys_shape [[buffer(1)]],
    const constant int64_t* keys_strides [[buffer(2)]],
    const device float* filters [[buffer(3)]],
    const constant int64_t* filters_strides [[buffer(4)]],
    const constant int* params [[buffer(5)]],
    device float* out [[buffer(6)]],
    uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]],
    uint3 threadgroups_per_grid [[threadgroups_per_grid]],
    uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups_per_threadgroup [[simdgroups_per_threadgroup]],
    uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]) {
  QF_SCORE_BODY(
      L,
      keys,
      keys_shape,
      keys_strides,
      filters,
      filters_strides,
      params,
      out,
      threadgroup_position_in_grid,
      threadgroups_per_grid,
      simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup,
      thread_index_in_simdgroup);
}

[[kernel]] void qfilters_select(
    const device float* scores [[buffer(0)]],
    const constant int* scores_shape [[buffer(1)]],
    const constant int64_t* scores_strides [[buffer(2)]],
    const constant int* params [[buffer(3)]],
    device int* kept [[buffer(4)]],
    uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]],
    uint thread_index_in_threadgroup [[thread_index_in_threadgroup]],
    uint3 threads_per_threadgroup [[threads_per_threadgroup]],
    uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],
    uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
    uint simdgroups_per_threadgroup [[simdgroups_per_threadgroup]]) {
  QF_SELECT_BODY(
      scores,
      scores_shape,
      scores_strides,
      params,
      kept,
      threadgroup_position_in_grid,
      thread_index_in_threadgroup,
      threads_per_threadgroup,
      thread_index_in_simdgroup,
      simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup);
}

template <typename T>
[[kernel]] void qfilters_gather(
    const device T* src [[buffer(0)]],
    const constant int* src_shape [[buffer(1)]],
    const constant int64_t* src_strides [[buffer(2)]],
    const device int* kept [[buffer(3)]],
    const constant int* kept_shape [[buffer(4)]],
    device T* out [[buffer(5)]],
    uint3 thread_position_in_grid [[thread_position_in_grid]],
    uint3 threads_per_grid [[threads_per_grid]]) {
  QF_GATHER_BODY(
      src,
      src_shape,
      src_strides,
      kept,
      kept_shape,
      out,
      thread_position_in_grid,
      threads_per_grid);
}

// clang-format off
QF_INSTANTIATE("qfilters_score_float32", qfilters_score, qf_f32, uint)
QF_INSTANTIATE("qfilters_score_float16", qfilters_score, qf_f16, ushort)
QF_INSTANTIATE("qfilters_score_bfloat16", qfilters_score, qf_bf16, ushort)
QF_INSTANTIATE("qfilters_gather_uint8", qfilters_gather, uchar)
QF_INSTANTIATE("qfilters_gather_uint16", qfilters_gather, ushort)
QF_INSTANTIATE("qfilters_gather_uint32", qfilters_gather, uint)
QF_INSTANTIATE("qfilters_gather_uint64", qfilters_gather, ulong)
// clang-format on
