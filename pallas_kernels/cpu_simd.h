// Pieces the C++ kernels for XLA:CPU share (pallas_kernels/cpu_build.py
// builds them with this folder on the include path): float32 lanes written
// with GCC/Clang vector extensions, so that one source builds for AVX-512,
// AVX2 or NEON; bfloat16 as its bits; and work shared between the calling
// thread and XLA's intra-op thread pool.

#ifndef PAGED_JAX_CPU_SIMD_H_
#define PAGED_JAX_CPU_SIMD_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace paged_jax {

inline float Widen(float x) { return x; }

inline float Widen(uint16_t bits) {  // bfloat16 bits
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

inline void Narrow(float x, float* out) { *out = x; }

inline void Narrow(float x, uint16_t* out) {  // to bfloat16: round to nearest even, NaN kept
  uint32_t word;
  std::memcpy(&word, &x, sizeof(word));
  if (std::isnan(x)) {
    *out = static_cast<uint16_t>((word >> 16) | 0x40);
    return;
  }
  *out = static_cast<uint16_t>((word + 0x7fff + ((word >> 16) & 1)) >> 16);
}

// 16 float32 lanes (one AVX-512 register, two AVX2 ones, four NEON ones).
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float HalfLanes __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float QuarterLanes __attribute__((vector_size(kLanes / 4 * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t WordLanes __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Bf16Lanes __attribute__((vector_size(kLanes * sizeof(uint16_t))));

template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

inline float Sum(Lanes v) {
  const float* lanes = reinterpret_cast<const float*>(&v);
  HalfLanes half = Load<HalfLanes>(lanes) + Load<HalfLanes>(lanes + kLanes / 2);
  const float* halves = reinterpret_cast<const float*>(&half);
  QuarterLanes quarter = Load<QuarterLanes>(halves) + Load<QuarterLanes>(halves + kLanes / 4);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

// 16 elements from p as float32.
inline Lanes LoadWide(const float* p) { return Load<Lanes>(p); }

inline Lanes LoadWide(const uint16_t* p) {
  return (Lanes)(__builtin_convertvector(Load<Bf16Lanes>(p), WordLanes) << 16);
}

// Calls work(item) for every item in [0, items), the items shared by the
// calling thread and up to pool.num_threads() - 1 tasks it schedules on the
// pool: each takes the next index from an atomic counter until none is left.
// Each task runs its own copy of `work` (state it keeps, such as scratch, is
// its own). The caller returns once every task that took an item has
// finished; a task that starts later finds none and touches nothing but the
// shared counters, so `work` is only ever called while the caller waits.
template <typename Work>
void ShareItems(xla::ffi::ThreadPool pool, int64_t items, Work work) {
  struct Queue {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
  };
  auto queue = std::make_shared<Queue>();
  auto drain = [items](Queue& shared, Work& worker) {
    for (int64_t item = shared.next++; item < items; item = shared.next++) worker(item);
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([queue, drain, work]() mutable {
      queue->active++;
      drain(*queue, work);
      queue->active--;
    });
  }
  drain(*queue, work);
  while (queue->active.load() > 0) std::this_thread::yield();
}

}  // namespace paged_jax

#endif  // PAGED_JAX_CPU_SIMD_H_
