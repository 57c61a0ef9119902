// Q-Filters Metal kernels: templates shared by both entry points.
//
//   * the metallib (metal/qfilters.metal, built by mlx_build_metallib when
//     MLX_BUILD_METAL is on, loaded by the C++ primitives' eval_gpu), and
//   * the JIT path (python/qfilters_mlx/backends/metal.py passes this file as
//     the `header` of mx.fast.metal_kernel and one QF_*_BODY(...) line as the
//     `source`; MLX writes the kernel signature).
//
// The same text also compiles as C++ on Linux against
// tests/metal_emu/metal_compat.h (QF_EMULATE), which runs every kernel body
// with one emulated thread per Metal thread; see tests/backends/test_metal_emulated.py.
// The file must therefore stay self-contained (the JIT header cannot resolve
// includes) and use only: address-space-free template pointer parameters,
// QF_TG for threadgroup arrays, threadgroup_barrier, atomic_{store,load,
// fetch_add}_explicit on threadgroup atomic_uint, simd_sum,
// simd_prefix_exclusive_sum, as_type, min.
//
// Semantics are those of python/qfilters_mlx/backends/reference.py (the oracle; this
// code shares nothing with it):
//   score  = sign * <k, u_h>, accumulated in float32;
//   select = first n_sink and last `recent[h]` positions always kept, the other
//            budget - n_sink - recent slots to the highest scores; equal
//            scores: the earlier position wins; NaN ranks with -inf (lowest);
//            -0.0 equals +0.0; K = min(budget, T) positions, ascending;
//   gather = bit-exact copies of the kept rows (copied as unsigned integers of
//            the element size, so NaN payloads and -0.0 survive).
//
// Pointer parameters are template types so that one function accepts device,
// constant (MLX passes inputs with fewer than 8 elements in the constant
// address space) and, in emulation, bounds-checked pointers.
#pragma once

#ifndef QF_EMULATE
#include <metal_stdlib>
using namespace metal;
// A threadgroup array declared at kernel scope (emulation: shared per group).
#define QF_TG(type, name, n) threadgroup type name[n]
#endif

// Metal threads per SIMD group on every Apple GPU (thread_execution_width).
#define QF_SIMD 32
// Threadgroup size of the scoring kernel and of the gather kernel.
#define QF_SCORE_TG 256
#define QF_GATHER_TG 256
// Largest threadgroup of the selection kernel; scratch below is sized for it.
#define QF_SELECT_MAX_TG 1024
#define QF_RADIX_BINS 256

// ---------------------------------------------------------------------------
// Element decoding: keys arrive as unsigned integers of their element size.
// ---------------------------------------------------------------------------

struct qf_f32 {
  static float load(uint bits) {
    return as_type<float>(bits);
  }
};
struct qf_f16 {
  static float load(ushort bits) {
    return float(as_type<half>(bits));
  }
};
struct qf_bf16 {
  static float load(ushort bits) {
    return as_type<float>(uint(bits) << 16);
  }
};

// An order-preserving map of a float32 score to uint32 (negative values are
// bit-inverted, the others get the sign bit set); NaN is first mapped to
// -inf and -0.0 to +0.0. Integer operations only, so fast math cannot change
// the ranking.
inline uint qf_ordered(float s) {
  uint bits = as_type<uint>(s);
  bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0xFF800000u : bits;
  bits = bits == 0x80000000u ? 0u : bits;
  return (bits >> 31) != 0u ? ~bits : (bits | 0x80000000u);
}

// ---------------------------------------------------------------------------
// Projection scores: one SIMD group per key row, lane d reads elements
// d, d + 32, ... (consecutive lanes read consecutive elements: coalesced for
// rows with unit stride), float32 products and accumulation, simd_sum.
// Grid-stride over rows, so any grid size is correct.
// ---------------------------------------------------------------------------

struct qf_score_args {
  int B, H, T, D;
  int64_t k0, k1, k2, k3; // key strides, elements
  int64_t f0, f1; // filter strides, elements
  float sign;
};

template <typename ShapeP, typename StrideP, typename ParamP>
inline qf_score_args qf_make_score_args(
    ShapeP keys_shape,
    StrideP keys_strides,
    StrideP filters_strides,
    ParamP params) {
  qf_score_args a;
  a.B = keys_shape[0];
  a.H = keys_shape[1];
  a.T = keys_shape[2];
  a.D = keys_shape[3];
  a.k0 = keys_strides[0];
  a.k1 = keys_strides[1];
  a.k2 = keys_strides[2];
  a.k3 = keys_strides[3];
  a.f0 = filters_strides[0];
  a.f1 = filters_strides[1];
  a.sign = params[0] < 0 ? -1.0f : 1.0f;
  return a;
}

template <typename L, typename KP, typename FP, typename OP>
inline void qf_score_rows(
    qf_score_args a,
    KP keys,
    FP filters,
    OP out,
    uint sg_global,
    uint sg_total,
    uint lane) {
  const int rows = a.B * a.H * a.T;
  for (int r = int(sg_global); r < rows; r += int(sg_total)) {
    const int t = r % a.T;
    const int bh = r / a.T;
    const int h = bh % a.H;
    const int b = bh / a.H;
    const int64_t base = b * a.k0 + h * a.k1 + t * a.k2;
    const int64_t fbase = h * a.f0;
    float acc = 0.0f;
    for (int d = int(lane); d < a.D; d += QF_SIMD) {
      acc += L::load(keys[base + d * a.k3]) * float(filters[fbase + d * a.f1]);
    }
    acc = simd_sum(acc);
    if (lane == 0u) {
      out[r] = a.sign * acc;
    }
  }
}

// Arguments: key storage, [B,H,T,D] shape and strides, filters [H,D] float32
// and strides, params[0] = sign, output [B,H,T] float32.
#define QF_SCORE_BODY(                                                    \
    L,                                                                    \
    keys,                                                                 \
    keys_shape,                                                           \
    keys_strides,                                                         \
    filters,                                                              \
    filters_strides,                                                      \
    params,                                                               \
    out,                                                                  \
    threadgroup_position_in_grid,                                         \
    threadgroups_per_grid,                                                \
    simdgroup_index_in_threadgroup,                                       \
    simdgroups_per_threadgroup,                                           \
    thread_index_in_simdgroup)                                            \
  qf_score_rows<L>(                                                       \
      qf_make_score_args(keys_shape, keys_strides, filters_strides, params), \
      keys,                                                               \
      filters,                                                            \
      out,                                                                \
      threadgroup_position_in_grid.x * simdgroups_per_threadgroup +       \
          simdgroup_index_in_threadgroup,                                 \
      threadgroups_per_grid.x * simdgroups_per_threadgroup,               \
      thread_index_in_simdgroup)

// ---------------------------------------------------------------------------
// Selection: one threadgroup per (batch, head) row.
//
// 1. Radix select (4 passes of 8 bits, most significant first) of the
//    n_pick-th largest ordered score v among the candidates [lo, hi), with a
//    256-bin threadgroup histogram; afterwards `ties` = how many candidates
//    equal to v are kept (the earliest ones) and every candidate above v is
//    kept. This is the selection by the uint64 key (ordered score, inverted
//    position) of the reference, without materialising the key.
// 2. Compaction in chunks of the threadgroup size: an exclusive scan of the
//    "forced or above v" and "equal to v" flags gives each kept position its
//    output slot directly, so the positions come out ascending:
//        slot(i) = #{forced or above, before i} + min(#{equal, before i}, ties).
//
// Threadgroup memory is a fixed 1.3 KB (histogram, per-SIMD-group totals,
// two broadcast words) whatever T and budget are: there is no cap on T or
// budget. The scores are read from device memory five times (four passes and
// the compaction); the positions are written straight to the output.
// Forced positions: [0, lo) and [hi, T). budget >= T: lo = hi = T (all kept).
// ---------------------------------------------------------------------------

struct qf_select_args {
  int B, H, T, K;
  int lo, hi, n_pick;
  int64_t s0, s1, s2; // score strides, elements
};

// params = {budget, n_sink, recent[0], ..., recent[H - 1]}: one recent
// window per head; row = b * H + h.
template <typename ShapeP, typename StrideP, typename ParamP>
inline qf_select_args qf_make_select_args(
    ShapeP scores_shape,
    StrideP scores_strides,
    ParamP params,
    uint row) {
  qf_select_args a;
  a.B = scores_shape[0];
  a.H = scores_shape[1];
  a.T = scores_shape[2];
  a.s0 = scores_strides[0];
  a.s1 = scores_strides[1];
  a.s2 = scores_strides[2];
  const int budget = params[0];
  const int n_sink = params[1];
  const int recent = params[2 + int(row % uint(a.H))];
  if (budget >= a.T) {
    a.K = a.T;
    a.lo = a.T;
    a.hi = a.T;
    a.n_pick = 0;
  } else {
    a.K = budget;
    a.lo = n_sink;
    a.hi = a.T - recent;
    a.n_pick = budget - n_sink - recent;
  }
  return a;
}

// tg_size must be a multiple of QF_SIMD and at most QF_SELECT_MAX_TG.
template <typename SP, typename KeptP, typename HistP, typename UP>
inline void qf_select_row(
    qf_select_args a,
    SP scores,
    KeptP kept,
    HistP hist,
    UP part,
    UP bcast,
    uint row,
    uint tid,
    uint tg_size,
    uint lane,
    uint sg,
    uint n_sg) {
  const int b = int(row) / a.H;
  const int h = int(row) % a.H;
  const int64_t sbase = b * a.s0 + h * a.s1;
  const int64_t kbase = int64_t(row) * a.K;

  // --- 1. radix select of the threshold ---------------------------------
  uint v = 0xFFFFFFFFu; // above every ordered score: nothing picked
  uint ties = 0u;
  if (a.n_pick > 0) {
    uint prefix = 0u;
    uint mask = 0u;
    uint need = uint(a.n_pick);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (uint i = tid; i < uint(QF_RADIX_BINS); i += tg_size) {
        atomic_store_explicit(&hist[i], 0u, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = a.lo + int(tid); i < a.hi; i += int(tg_size)) {
        const uint o = qf_ordered(scores[sbase + i * a.s2]);
        if ((o & mask) == prefix) {
          atomic_fetch_add_explicit(
              &hist[(o >> shift) & 255u], 1u, memory_order_relaxed);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (sg == 0u) {
        // Lane l owns bins [8 (31 - l), 8 (31 - l) + 8): lane 0 the top ones,
        // so the exclusive prefix sum over lanes counts the bins above.
        const uint chunk = 31u - lane;
        uint c[8];
        uint tot = 0u;
        for (int j = 0; j < 8; ++j) {
          c[j] = atomic_load_explicit(&hist[chunk * 8u + uint(j)],
                                      memory_order_relaxed);
          tot += c[j];
        }
        const uint above = simd_prefix_exclusive_sum(tot);
        if (above < need && need <= above + tot) {
          uint cum = above;
          int j = 7;
          while (cum + c[j] < need) {
            cum += c[j];
            --j;
          }
          bcast[0] = prefix | ((chunk * 8u + uint(j)) << shift);
          bcast[1] = need - cum;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      prefix = bcast[0];
      need = bcast[1];
      mask |= 255u << shift;
    }
    v = prefix;
    ties = need;
  }

  // --- 2. order-preserving compaction -----------------------------------
  // Per chunk: flags packed as fg | eq << 16 (a chunk has at most 1024
  // threads, so the 16-bit halves cannot carry). SIMD-group totals go to
  // part[parity * 32 + sg]; double buffering needs one barrier per chunk.
  uint run_fg = 0u;
  uint run_eq = 0u;
  uint parity = 0u;
  for (int base = 0; base < a.T; base += int(tg_size)) {
    const int i = base + int(tid);
    bool fg = false;
    bool eq = false;
    if (i < a.T) {
      if (i < a.lo || i >= a.hi) {
        fg = true;
      } else {
        const uint o = qf_ordered(scores[sbase + i * a.s2]);
        fg = o > v;
        eq = o == v;
      }
    }
    const uint packed = (fg ? 1u : 0u) | (eq ? 0x10000u : 0u);
    const uint pre_sg = simd_prefix_exclusive_sum(packed);
    const uint tot_sg = simd_sum(packed);
    if (lane == 0u) {
      part[parity * 32u + sg] = tot_sg;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint before = 0u;
    uint total = 0u;
    for (uint s = 0u; s < n_sg; ++s) {
      const uint x = part[parity * 32u + s];
      before += s < sg ? x : 0u;
      total += x;
    }
    const uint pre = before + pre_sg;
    const uint e = run_eq + (pre >> 16);
    const uint slot_fg = run_fg + (pre & 0xFFFFu);
    if (fg) {
      kept[kbase + int64_t(slot_fg + min(e, ties))] = i;
    } else if (eq && e < ties) {
      kept[kbase + int64_t(slot_fg + e)] = i;
    }
    run_fg += total & 0xFFFFu;
    run_eq += total >> 16;
    parity ^= 1u;
  }
}

// Arguments: scores [B,H,T] float32 with shape and strides, params =
// {budget, n_sink, recent[0], ..., recent[H - 1]}, output kept [B,H,K] int32 (row-contiguous).
// Grid: one threadgroup per row (B * H threadgroups, 1-D).
#define QF_SELECT_BODY(                                                     \
    scores,                                                                 \
    scores_shape,                                                           \
    scores_strides,                                                         \
    params,                                                                 \
    kept,                                                                   \
    threadgroup_position_in_grid,                                           \
    thread_index_in_threadgroup,                                            \
    threads_per_threadgroup,                                                \
    thread_index_in_simdgroup,                                              \
    simdgroup_index_in_threadgroup,                                         \
    simdgroups_per_threadgroup)                                             \
  QF_TG(atomic_uint, qf_hist, QF_RADIX_BINS);                               \
  QF_TG(uint, qf_part, 2 * QF_SELECT_MAX_TG / QF_SIMD);                     \
  QF_TG(uint, qf_bcast, 2);                                                 \
  qf_select_row(                                                            \
      qf_make_select_args(                                                  \
          scores_shape, scores_strides, params,                             \
          threadgroup_position_in_grid.x),                                  \
      scores,                                                               \
      kept,                                                                 \
      qf_hist,                                                              \
      qf_part,                                                              \
      qf_bcast,                                                             \
      threadgroup_position_in_grid.x,                                       \
      thread_index_in_threadgroup,                                          \
      threads_per_threadgroup.x,                                            \
      thread_index_in_simdgroup,                                            \
      simdgroup_index_in_threadgroup,                                       \
      simdgroups_per_threadgroup)

// ---------------------------------------------------------------------------
// Gather: out[b, h, k, d] = src[b, h, kept[b, h, k], d], one element per
// thread (grid-stride), consecutive threads write consecutive elements.
// Elements are copied as unsigned integers of their size: bit-exact.
// ---------------------------------------------------------------------------

struct qf_gather_args {
  int B, H, K, D;
  int64_t x0, x1, x2, x3; // source strides, elements
};

template <typename ShapeP, typename StrideP, typename KShapeP>
inline qf_gather_args qf_make_gather_args(
    ShapeP src_shape,
    StrideP src_strides,
    KShapeP kept_shape) {
  qf_gather_args a;
  a.B = src_shape[0];
  a.H = src_shape[1];
  a.D = src_shape[3];
  a.K = kept_shape[2];
  a.x0 = src_strides[0];
  a.x1 = src_strides[1];
  a.x2 = src_strides[2];
  a.x3 = src_strides[3];
  return a;
}

// The host guarantees B * H * K * D < 2^31, so indices fit 32-bit integers
// (64-bit division is slow on Apple GPUs); addresses are 64-bit.
template <typename XP, typename KeptP, typename OP>
inline void qf_gather_rows(
    qf_gather_args a,
    XP src,
    KeptP kept,
    OP out,
    uint gid,
    uint n_threads) {
  const uint D = uint(a.D);
  const uint K = uint(a.K);
  const uint H = uint(a.H);
  const uint total = uint(a.B) * H * K * D;
  for (uint j = gid; j < total; j += n_threads) {
    const uint r = j / D; // row of kept: (b * H + h) * K + k
    const uint d = j - r * D;
    const uint bh = r / K;
    const uint h = bh % H;
    const uint b = bh / H;
    const int64_t t = kept[r];
    out[j] = src[int64_t(b) * a.x0 + int64_t(h) * a.x1 + t * a.x2 +
                 int64_t(d) * a.x3];
  }
}

// Arguments: src [B,H,T,D] storage with shape and strides, kept [B,H,K]
// int32 with shape, output [B,H,K,D] (same storage type, row-contiguous).
#define QF_GATHER_BODY(                                                     \
    src,                                                                    \
    src_shape,                                                              \
    src_strides,                                                            \
    kept,                                                                   \
    kept_shape,                                                             \
    out,                                                                    \
    thread_position_in_grid,                                                \
    threads_per_grid)                                                       \
  qf_gather_rows(                                                           \
      qf_make_gather_args(src_shape, src_strides, kept_shape),              \
      src,                                                                  \
      kept,                                                                 \
      out,                                                                  \
      thread_position_in_grid.x,                                            \
      threads_per_grid.x)
