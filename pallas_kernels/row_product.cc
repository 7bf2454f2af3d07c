// A few bfloat16 rows times a bfloat16 weight stored [n, k] (x @ w.T), summed
// in float32, on XLA:CPU, called through JAX's FFI (pallas_kernels/
// row_product.py builds and registers it).
//
// The products run in tiles of up to 4 rows of x by 4 weight rows: each
// weight row is read from memory once per call, and each loaded piece of a
// weight row or of x serves 4 products. With AVX-512 BF16 the pieces are 32
// bfloat16 and vdpbf16ps multiplies them pairwise into float32 sums; without
// it, 16 weights at a time are widened to float32 in registers and
// multiplied with x (widened once per call). Runs of output columns are
// shared between the calling thread and XLA's intra-op thread pool.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace paged_jax;  // NOLINT: the kernels' shared pieces (cpu_simd.h)

constexpr int64_t kOutputsPerItem = 64;
constexpr int kTileRows = 4;     // rows of x per tile
constexpr int kTileOutputs = 4;  // weight rows (output columns) per tile

// One product's operands: x [m, k] and w [n, k] (bfloat16 bits, x also as
// float32 where the widening path needs it) and y [m, n].
struct Operands {
  const uint16_t* x;
  const float* x_wide;
  const uint16_t* w;
  float* y;
  int64_t m, n, k;
};

#if defined(__AVX512BF16__)

inline __m512bh LoadPairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

inline __m512bh LoadPairs(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// The sums of 16 registers v[0..15], lane i holding v[i]'s: pairs of
// registers are interleaved and added, halving the registers and the lanes
// each sum spans, until one register is left.
inline __m512 SumEach(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // lanes (a0+a2, b0+b2, a1+a3, b1+b3) in each quarter
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // lanes (a, b, c, d) in each quarter, over that quarter
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Quarter q of the result: the four quarters of quads[q] added.
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xdd));
}

// y[r, c] for the R rows from `row` and the C weight rows from `col`.
template <int R, int C>
void Tile(const Operands& o, int64_t row, int64_t col) {
  const int64_t k = o.k;
  const uint16_t* x = o.x + row * k;
  const uint16_t* w = o.w + col * k;
  __m512 acc[R * C];  // acc[r * C + c]
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  auto step = [&](int64_t at, auto load) {
    __m512bh ws[C];
    for (int c = 0; c < C; ++c) {
      ws[c] = load(w + c * k + at);
      // The next tile's weights (past w's end near it: a prefetch never faults).
      _mm_prefetch(reinterpret_cast<const char*>(w + (C + c) * k + at), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xs = load(x + r * k + at);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xs, ws[c]);
    }
  };
  int64_t at = 0;
  for (; at + 32 <= k; at += 32) step(at, [](const uint16_t* p) { return LoadPairs(p); });
  if (at < k) {  // the tail, zero past k
    const __mmask32 mask = _cvtu32_mask32((1u << (k - at)) - 1);
    step(at, [mask](const uint16_t* p) { return LoadPairs(p, mask); });
  }
  if constexpr (R * C == 16) {
    float sums[16];
    _mm512_storeu_ps(sums, SumEach(acc));
    for (int r = 0; r < R; ++r) std::memcpy(o.y + (row + r) * o.n + col, sums + r * C, C * 4);
  } else {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        o.y[(row + r) * o.n + col + c] = _mm512_reduce_add_ps(acc[r * C + c]);
      }
    }
  }
}

// x . w for one row of each: four sums over runs of 128, so that the adds
// overlap while the weight row streams through once.
float RowDot(const uint16_t* x, const uint16_t* w, int64_t k) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t at = 0;
  for (; at + 128 <= k; at += 128) {
    for (int a = 0; a < 4; ++a) {
      acc[a] = _mm512_dpbf16_ps(acc[a], LoadPairs(x + at + 32 * a), LoadPairs(w + at + 32 * a));
    }
  }
  for (; at + 32 <= k; at += 32) {
    acc[0] = _mm512_dpbf16_ps(acc[0], LoadPairs(x + at), LoadPairs(w + at));
  }
  if (at < k) {
    const __mmask32 mask = _cvtu32_mask32((1u << (k - at)) - 1);
    acc[1] = _mm512_dpbf16_ps(acc[1], LoadPairs(x + at, mask), LoadPairs(w + at, mask));
  }
  const __m512 pairs = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  return _mm512_reduce_add_ps(pairs);
}

// Row `row` of y, columns [begin, end).
void OneRow(const Operands& o, int64_t row, int64_t begin, int64_t end) {
  for (int64_t col = begin; col < end; ++col) {
    o.y[row * o.n + col] = RowDot(o.x + row * o.k, o.w + col * o.k, o.k);
  }
}

#else

template <int R, int C>
void Tile(const Operands& o, int64_t row, int64_t col) {
  const int64_t k = o.k;
  const float* x = o.x_wide + row * k;
  const uint16_t* w = o.w + col * k;
  Lanes acc[R][C] = {};
  int64_t at = 0;
  for (; at + kLanes <= k; at += kLanes) {
    Lanes ws[C];
    for (int c = 0; c < C; ++c) ws[c] = LoadWide(w + c * k + at);
    for (int r = 0; r < R; ++r) {
      const Lanes xs = LoadWide(x + r * k + at);
      for (int c = 0; c < C; ++c) acc[r][c] += xs * ws[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = Sum(acc[r][c]);
      for (int64_t tail = at; tail < k; ++tail) sum += x[r * k + tail] * Widen(w[c * k + tail]);
      o.y[(row + r) * o.n + col + c] = sum;
    }
  }
}

// x . w for one row of each (x widened): four sums, so that the adds overlap
// while the weight row streams through once.
float RowDot(const float* x, const uint16_t* w, int64_t k) {
  Lanes acc[4] = {};
  int64_t at = 0;
  for (; at + 4 * kLanes <= k; at += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) {
      acc[a] += LoadWide(w + at + a * kLanes) * LoadWide(x + at + a * kLanes);
    }
  }
  for (; at + kLanes <= k; at += kLanes) acc[0] += LoadWide(w + at) * LoadWide(x + at);
  float sum = Sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; at < k; ++at) sum += Widen(w[at]) * x[at];
  return sum;
}

// Row `row` of y, columns [begin, end).
void OneRow(const Operands& o, int64_t row, int64_t begin, int64_t end) {
  for (int64_t col = begin; col < end; ++col) {
    o.y[row * o.n + col] = RowDot(o.x_wide + row * o.k, o.w + col * o.k, o.k);
  }
}

#endif

// The R rows from `row` times the weight rows [begin, end): C at a time,
// then one.
template <int R, int C>
void Columns(const Operands& o, int64_t row, int64_t begin, int64_t end) {
  int64_t col = begin;
  for (; col + C <= end; col += C) Tile<R, C>(o, row, col);
  for (; col < end; ++col) Tile<R, 1>(o, row, col);
}

// Every row of x times the weight rows [begin, end): tiles of 4 rows by 4
// weight rows (each tile's weights serve every 4 rows while they are in
// L1), then the last 2 or 3 rows with more weight rows per tile, so that
// a tile still keeps 12 to 16 sums going, or the last row one weight row
// at a time.
void Item(const Operands& o, int64_t begin, int64_t end) {
  const int64_t whole = o.m / kTileRows * kTileRows;
  int64_t col = begin;
  for (; col + kTileOutputs <= end; col += kTileOutputs) {
    for (int64_t row = 0; row < whole; row += kTileRows) Tile<kTileRows, kTileOutputs>(o, row, col);
  }
  for (; col < end; ++col) {
    for (int64_t row = 0; row < whole; row += kTileRows) Tile<kTileRows, 1>(o, row, col);
  }
  switch (o.m - whole) {
    case 3: return Columns<3, 4>(o, whole, begin, end);
    case 2: return Columns<2, 8>(o, whole, begin, end);
    case 1: return OneRow(o, whole, begin, end);
  }
}

ffi::Error RowProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto x_dims = x.dimensions(), w_dims = w.dimensions(), y_dims = out->dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || w_dims[1] != x_dims[1] ||
      y_dims.size() != 2 || y_dims[0] != x_dims[0] || y_dims[1] != w_dims[0]) {
    return ffi::Error::InvalidArgument("row product: x must be [m, k], w [n, k] and out [m, n]");
  }
  Operands o{reinterpret_cast<const uint16_t*>(x.typed_data()), nullptr,
             reinterpret_cast<const uint16_t*>(w.typed_data()), out->typed_data(),
             x_dims[0], w_dims[0], w_dims[1]};
#if !defined(__AVX512BF16__)
  std::vector<float> x_wide(o.m * o.k);
  for (int64_t i = 0; i < o.m * o.k; ++i) x_wide[i] = Widen(o.x[i]);
  o.x_wide = x_wide.data();
#endif
  const int64_t items = (o.n + kOutputsPerItem - 1) / kOutputsPerItem;
  ShareItems(pool, items, [&](int64_t item) {
    Item(o, item * kOutputsPerItem, std::min(o.n, (item + 1) * kOutputsPerItem));
  });
  return ffi::Error::Success();
}

// The same, writing over a buffer passed in (aliased to the result), so that
// tests can fill it first and see every element the kernel does not write.
ffi::Error RowProductInto(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::AnyBuffer,
                          ffi::Result<ffi::Buffer<ffi::F32>> out) {
  return RowProduct(pool, x, w, out);
}

auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::BF16>>()   // x [m, k]
      .Arg<ffi::Buffer<ffi::BF16>>();  // w [n, k]
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowProductCpu, RowProduct,
                              BindOperands().Ret<ffi::Buffer<ffi::F32>>());  // [m, n]
XLA_FFI_DEFINE_HANDLER_SYMBOL(RowProductIntoCpu, RowProductInto,
                              BindOperands().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());
