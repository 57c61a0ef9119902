// Metal compatibility layer: lets metal/qfilters.h compile as C++20 and run
// on the CPU, one emulated thread per Metal thread (tests only; not shipped).
//
// What is emulated, and how:
//   * address spaces: kernels take template pointer types; the launcher passes
//     bounds-checked pointers (Ptr: read/write, index checked against the
//     allocation; OutPtr: write-only, counts the writes of every element so
//     the driver can prove each output element is written exactly once).
//   * QF_TG(type, name, n): threadgroup arrays, one instance per threadgroup
//     shared by its threads, filled with 0xCD bytes (uninitialised memory).
//   * threadgroup_barrier: every thread of the group must arrive at the same
//     call (checked by source line at each phase), and none may finish
//     while others wait, else the run stops with "barrier divergence" or
//     "deadlock".
//   * simd_sum, simd_prefix_exclusive_sum: exchange through per-SIMD-group
//     slots with a 32-lane barrier (all lanes must take part, as the kernels
//     call them in uniform control flow); lanes of a SIMD group are threads
//     32 s .. 32 s + 31 of the group, as on Apple GPUs.
//   * atomics on threadgroup memory: std::atomic<uint32_t>.
//   * half: IEEE binary16 decoded exactly in software; as_type: bit copy.
//
// Two schedulers (Mode): `threads` runs each threadgroup's threads as real
// std::threads with std::barrier (true concurrency: races can show up);
// `fibers` runs them as cooperative ucontext fibers on one OS thread,
// resumed in a fresh random order after every barrier (deterministic for a
// seed, fast enough for the whole equivalence matrix; any read of shared data
// that is not ordered by a barrier sees a different writer order from run to
// run).
#pragma once

#define QF_EMULATE 1

#include <setjmp.h>
#include <sys/types.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

// ---------------------------------------------------------------------------
// Scalar types and helpers of the Metal standard library
// ---------------------------------------------------------------------------

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
static_assert(sizeof(ulong) == 8, "LP64 expected");

struct uint3 {
  uint x, y, z;
};

// IEEE binary16, decoded exactly (normals, subnormals, zeros, inf, NaN).
struct half {
  uint16_t bits;
  explicit operator float() const {
    const uint32_t sign = (uint32_t(bits) & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1Fu;
    const uint32_t man = bits & 0x3FFu;
    uint32_t out;
    if (exp == 0x1Fu) {
      out = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0u) {
      out = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0u) {
      out = sign;
    } else {  // subnormal: man * 2^-24, exact in float32
      float f = float(man) * 0x1.0p-24f;
      uint32_t fb;
      std::memcpy(&fb, &f, 4);
      out = sign | fb;
    }
    float f;
    std::memcpy(&f, &out, 4);
    return f;
  }
};

template <typename To, typename From>
inline To as_type(From from) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

using atomic_uint = std::atomic<uint32_t>;
enum memory_order { memory_order_relaxed };
inline void atomic_store_explicit(atomic_uint* p, uint v, memory_order) {
  p->store(v, std::memory_order_relaxed);
}
inline uint atomic_load_explicit(atomic_uint* p, memory_order) {
  return p->load(std::memory_order_relaxed);
}
inline uint atomic_fetch_add_explicit(atomic_uint* p, uint v, memory_order) {
  return p->fetch_add(v, std::memory_order_relaxed);
}

enum class mem_flags {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4
};

namespace qfemu {

[[noreturn]] void fatal(const std::string& msg);

// ---------------------------------------------------------------------------
// Bounds-checked pointers
// ---------------------------------------------------------------------------

// Valid indices: [lo, hi) relative to p (lo < 0 for views with negative
// strides whose first element is not at the start of the allocation).
template <typename T>
struct Ptr {
  T* p = nullptr;
  int64_t lo = 0, hi = 0;
  const char* name = "?";
  T& operator[](int64_t i) const {
    if (i < lo || i >= hi) {
      fatal(std::string("out-of-bounds access to ") + name + "[" +
            std::to_string(i) + "], valid [" + std::to_string(lo) + ", " +
            std::to_string(hi) + ")");
    }
    return p[i];
  }
};

// Write-only output: each write is counted (atomically) per element.
template <typename T>
struct OutPtr {
  T* p = nullptr;
  std::atomic<uint32_t>* writes = nullptr;
  int64_t n = 0;
  const char* name = "?";
  struct Ref {
    T* p;
    std::atomic<uint32_t>* w;
    template <typename U>
    Ref& operator=(U v) {
      *p = static_cast<T>(v);
      w->fetch_add(1, std::memory_order_relaxed);
      return *this;
    }
  };
  Ref operator[](int64_t i) const {
    if (i < 0 || i >= n) {
      fatal(std::string("out-of-bounds write to ") + name + "[" +
            std::to_string(i) + "], valid [0, " + std::to_string(n) + ")");
    }
    return Ref{p + i, writes + i};
  }
};

// ---------------------------------------------------------------------------
// Threads, groups, schedulers
// ---------------------------------------------------------------------------

enum class Mode { fibers, threads };

struct Group;

// Launch attributes of one thread (1-D launches).
struct Attrs {
  uint3 thread_position_in_grid, threads_per_grid;
  uint3 threadgroup_position_in_grid, threadgroups_per_grid;
  uint3 threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup, simdgroups_per_threadgroup;
};

// Counting barrier for the fiber scheduler.
struct CBarrier {
  int n = 0, arrived = 0;
  uint64_t gen = 0;
};

struct Fiber {
  ucontext_t ctx;  // first entry only
  jmp_buf jb;      // where the fiber last yielded
  bool started = false;
  bool done = false;
  const uint64_t* wait_gen = nullptr;  // blocked while *wait_gen == wait_val
  uint64_t wait_val = 0;
  std::function<void()> body;
};

struct Lane {
  Group* group = nullptr;
  Fiber* fiber = nullptr;  // fibers mode
  uint tid = 0, lane = 0, sg = 0;
  uint64_t simd_count = 0;
};

// Barrier completion checks: every thread must have arrived from the same
// call site (source line of threadgroup_barrier / the SIMD-group function),
// as Metal requires; run once per phase, before any release.
struct TgCheck {
  Group* g;
  void operator()() noexcept;
};
struct SgCheck {
  Group* g;
  int sg;
  void operator()() noexcept;
};

struct Group {
  Mode mode;
  int n = 0, n_sg = 0;
  // fibers
  CBarrier tgb;
  std::vector<CBarrier> sgb;
  // threads
  std::unique_ptr<std::barrier<TgCheck>> ttgb;
  std::vector<std::unique_ptr<std::barrier<SgCheck>>> tsgb;
  // SIMD exchange slots (double-buffered by parity) and call sites
  struct Simd {
    uint64_t slot[2][32];
    const void* site[32];
  };
  std::vector<Simd> simd;
  std::vector<const void*> tg_site;
  // threadgroup memory
  std::mutex arena_mtx;
  std::map<std::string, std::vector<unsigned char>> arena;
};

inline void TgCheck::operator()() noexcept {
  for (int t = 1; t < g->n; ++t) {
    if (g->tg_site[t] != g->tg_site[0]) {
      fatal("barrier divergence: threads 0 and " + std::to_string(t) +
            " wait at different threadgroup_barrier calls");
    }
  }
}

inline void SgCheck::operator()() noexcept {
  const Group::Simd& s = g->simd[sg];
  for (int t = 1; t < 32; ++t) {
    if (s.site[t] != s.site[0]) {
      fatal("SIMD divergence: lanes 0 and " + std::to_string(t) +
            " of SIMD group " + std::to_string(sg) +
            " are at different SIMD-group function calls");
    }
  }
}

extern thread_local Lane* cur;
extern thread_local jmp_buf* sched_jb;
extern std::atomic<uint64_t> progress;

inline void fiber_yield() {
  Fiber* f = cur->fiber;
  if (_setjmp(f->jb) == 0) {
    _longjmp(*sched_jb, 1);
  }
}

template <typename Check>
inline void cbarrier_arrive(CBarrier& b, Check check) {
  const uint64_t g = b.gen;
  if (++b.arrived == b.n) {
    check();
    b.arrived = 0;
    ++b.gen;
    return;
  }
  cur->fiber->wait_gen = &b.gen;
  cur->fiber->wait_val = g;
  fiber_yield();
}

inline void barrier_tg(const void* site) {
  Lane& l = *cur;
  Group& g = *l.group;
  g.tg_site[l.tid] = site;
  if (g.mode == Mode::fibers) {
    cbarrier_arrive(g.tgb, TgCheck{&g});
  } else {
    g.ttgb->arrive_and_wait();
  }
  progress.fetch_add(1, std::memory_order_relaxed);
}

// Publish `bits`, wait for the 32 lanes of the SIMD group, return the slots.
inline const uint64_t* simd_exchange(uint64_t bits, const void* site) {
  Lane& l = *cur;
  Group& g = *l.group;
  Group::Simd& s = g.simd[l.sg];
  const int par = int(l.simd_count & 1u);
  s.slot[par][l.lane] = bits;
  s.site[l.lane] = site;
  if (g.mode == Mode::fibers) {
    cbarrier_arrive(g.sgb[l.sg], SgCheck{&g, int(l.sg)});
  } else {
    g.tsgb[l.sg]->arrive_and_wait();
  }
  ++l.simd_count;
  return s.slot[par];
}

template <typename T>
inline uint64_t to_bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Threadgroup array `name` of the current group (first caller allocates).
template <typename T>
Ptr<T> tg_array(const char* name, int n) {
  Group& g = *cur->group;
  std::lock_guard<std::mutex> lock(g.arena_mtx);
  auto it = g.arena.find(name);
  if (it == g.arena.end()) {
    it = g.arena.emplace(name, std::vector<unsigned char>(sizeof(T) * n, 0xCD))
             .first;
  }
  if (it->second.size() != sizeof(T) * size_t(n)) {
    fatal(std::string("threadgroup array ") + name + " redeclared");
  }
  Ptr<T> p;
  p.p = reinterpret_cast<T*>(it->second.data());
  p.lo = 0;
  p.hi = n;
  p.name = name;
  return p;
}

using KernelFn = std::function<void(const Attrs&)>;

// Runs a 1-D launch: grid_threads threads in groups of tg_threads (grid a
// multiple of tg, tg a multiple of 32, as the host code guarantees).
// Threadgroups run one after another; the threads of a group concurrently.
void launch(uint grid_threads, uint tg_threads, Mode mode, uint64_t seed,
            const KernelFn& fn);

}  // namespace qfemu

// Metal functions the kernels call. They are macros so that each call
// carries its source line: the divergence checks compare call sites, and a
// return address would not do (the optimiser may duplicate a call).
inline void qf_emu_barrier(int line) {
  qfemu::barrier_tg(reinterpret_cast<const void*>(intptr_t(line)));
}
#define threadgroup_barrier(flags) qf_emu_barrier(__LINE__)

template <typename T>
inline T qf_emu_simd_sum(T v, int line) {
  const uint64_t* s = qfemu::simd_exchange(
      qfemu::to_bits(v), reinterpret_cast<const void*>(intptr_t(line)));
  T acc = T(0);
  for (int i = 0; i < 32; ++i) {
    acc += qfemu::from_bits<T>(s[i]);
  }
  return acc;
}
#define simd_sum(v) qf_emu_simd_sum((v), __LINE__)

template <typename T>
inline T qf_emu_simd_prefix_exclusive_sum(T v, int line) {
  const uint64_t* s = qfemu::simd_exchange(
      qfemu::to_bits(v), reinterpret_cast<const void*>(intptr_t(line)));
  T acc = T(0);
  for (uint i = 0; i < qfemu::cur->lane; ++i) {
    acc += qfemu::from_bits<T>(s[i]);
  }
  return acc;
}
#define simd_prefix_exclusive_sum(v) \
  qf_emu_simd_prefix_exclusive_sum((v), __LINE__)

#define QF_TG(type, name, n) auto name = qfemu::tg_array<type>(#name, (n))
