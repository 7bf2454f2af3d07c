// The product x @ dequant(w).T of weights kept quantized, for a few rows of
// x on XLA:CPU, called through JAX's FFI (pallas_kernels/quantized_matmul/
// cpu.py builds and registers it).
//
// Weight (r, c) is ints[r, c] * scales[r, g] + minimums[r, g] with
// g = c / group_size, in float32: the weight the float32-dequantized model
// has (up to the one rounding of a fused multiply-add). ints are int8
// [n, k], or 4-bit values packed two a byte in row halves (uint8 [n, k / 2]:
// byte c holds input c in its low nibble and input c + k / 2 in its high
// one). Each weight is computed in registers as it is multiplied, from the
// bytes read once: for 4 bits, 16 bytes give 16 inputs of each half; so no
// float weight is written anywhere. x (float32, or bfloat16 widened once per
// call) and the sums are float32. Output rows are shared, in runs, between
// the calling thread and XLA's intra-op thread pool.
//
// Vector loops serve rows whose stored columns (for 4 bits, each half) and
// group size are multiples of 16, so that each run of 16 inputs lies in one
// group; other shapes run plain loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paged_jax;  // NOLINT: the kernels' shared pieces (cpu_simd.h)

constexpr int64_t kMaxRowsAtOnce = 4;  // rows of x multiplied per pass over a weight row
constexpr int64_t kOutputsPerItem = 16;

// float16 bits to float32, exactly (subnormals included, computed without
// subnormal float arithmetic, which XLA's threads may flush to zero).
inline float HalfToFloat(uint16_t half) {
  uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
  uint32_t exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
  uint32_t wide = exponent == 0x1F ? 0xFF : exponent + 112;  // 127 - 15; inf and NaN stay
  uint32_t normal = sign | (wide << 23) | (mantissa << 13);
  float value;
  std::memcpy(&value, &normal, sizeof(value));
  float subnormal = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
  return exponent == 0 ? (sign ? -subnormal : subnormal) : value;
}

// Rows [first, first + rows) of a [n, groups] float16 or float32 array, as
// float32 (contiguous; F16C's conversion where there is one: exact, and
// subnormals are not flushed).
void GroupsAsFloat(const void* data, bool half, int64_t first, int64_t rows, int64_t groups,
                   float* out) {
  const int64_t count = rows * groups, start = first * groups;
  if (!half) {
    std::memcpy(out, static_cast<const float*>(data) + start, count * sizeof(float));
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(data) + start;
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + kLanes <= count; i += kLanes) {
    __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i));
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(halves));
  }
#endif
  for (; i < count; ++i) out[i] = HalfToFloat(bits[i]);
}

struct Shapes {
  int64_t m, n, k, bits, group_size;
  int64_t stored() const { return bits == 4 ? k / 2 : k; }
  int64_t groups() const { return k / group_size; }
  bool in_lanes() const { return stored() % kLanes == 0 && group_size % kLanes == 0; }
};

// 16 bytes as int32 lanes, zero- or sign-extended (one instruction on
// AVX-512; GCC's vector conversion from bytes is scalar there).
template <typename Byte>
inline IntLanes WidenBytes(const Byte* p) {
#ifdef __AVX512F__
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<Byte>) return (IntLanes)_mm512_cvtepi8_epi32(bytes);
  return (IntLanes)_mm512_cvtepu8_epi32(bytes);
#else
  typedef Byte Bytes __attribute__((vector_size(kLanes)));
  typedef std::conditional_t<std::is_signed_v<Byte>, int16_t, uint16_t> Half;
  typedef Half Halves __attribute__((vector_size(kLanes * sizeof(Half))));
  return __builtin_convertvector(__builtin_convertvector(Load<Bytes>(p), Halves), IntLanes);
#endif
}

// Products of M rows of x (float32 [M, k], rows `ldx` apart) with one
// weight row, in vector loops; `run_group[j]` is the group of inputs
// [16 j, 16 j + 16). Each row of x has four accumulators (runs of 16
// bytes taken two at a time, two halves) so that the adds are independent.
template <int64_t M, int Bits>
void RowDotLanes(const Shapes& s, const void* weights, const float* x, int64_t ldx,
                 const float* scales, const float* minimums, const int32_t* run_group,
                 float* out, int64_t ldo) {
  constexpr int64_t kHalves = Bits == 4 ? 2 : 1;
  const int64_t runs = s.stored() / kLanes;
  Lanes even[M][kHalves] = {}, odd[M][kHalves] = {};
  auto run = [&](int64_t j, Lanes(&acc)[M][kHalves]) {
    Lanes parts[kHalves];
    if constexpr (Bits == 4) {
      IntLanes bytes = WidenBytes(static_cast<const uint8_t*>(weights) + j * kLanes);
      parts[0] = __builtin_convertvector(bytes & 0x0F, Lanes);
      parts[1] = __builtin_convertvector(bytes >> 4, Lanes);
    } else {
      parts[0] = __builtin_convertvector(
          WidenBytes(static_cast<const int8_t*>(weights) + j * kLanes), Lanes);
    }
    for (int64_t h = 0; h < kHalves; ++h) {
      int64_t input_run = j + h * runs, g = run_group[input_run];
      Lanes w = parts[h] * scales[g];
      if (minimums != nullptr) w += minimums[g];
      for (int64_t i = 0; i < M; ++i) {
        acc[i][h] += w * Load<Lanes>(x + i * ldx + input_run * kLanes);
      }
    }
  };
  int64_t j = 0;
  for (; j + 1 < runs; j += 2) {
    run(j, even);
    run(j + 1, odd);
  }
  if (j < runs) run(j, even);
  for (int64_t i = 0; i < M; ++i) {
    Lanes total = even[i][0] + odd[i][0];
    for (int64_t h = 1; h < kHalves; ++h) total += even[i][h] + odd[i][h];
    out[i * ldo] = Sum(total);
  }
}

// The same for any shape, one input at a time.
void RowDotPlain(const Shapes& s, const void* weights, const float* x, int64_t ldx, int64_t rows,
                 const float* scales, const float* minimums, float* out, int64_t ldo) {
  const int64_t stored = s.stored();
  for (int64_t i = 0; i < rows; ++i) {
    float sum = 0.0f;
    for (int64_t c = 0; c < s.k; ++c) {
      float value;
      if (s.bits == 4) {
        uint8_t byte = static_cast<const uint8_t*>(weights)[c % stored];
        value = c < stored ? (byte & 0x0F) : (byte >> 4);
      } else {
        value = static_cast<const int8_t*>(weights)[c];
      }
      int64_t g = c / s.group_size;
      float w = value * scales[g];
      if (minimums != nullptr) w += minimums[g];
      sum += w * x[i * ldx + c];
    }
    out[i * ldo] = sum;
  }
}

template <int Bits>
void RowDot(const Shapes& s, const void* weights, const float* x, int64_t rows,
            const float* scales, const float* minimums, const int32_t* run_group, float* out) {
  if (!s.in_lanes()) {
    RowDotPlain(s, weights, x, s.k, rows, scales, minimums, out, s.n);
    return;
  }
  for (int64_t first = 0; first < rows; first += kMaxRowsAtOnce) {
    const float* xs = x + first * s.k;
    float* outs = out + first * s.n;
    switch (std::min(rows - first, kMaxRowsAtOnce)) {
      case 1: RowDotLanes<1, Bits>(s, weights, xs, s.k, scales, minimums, run_group, outs, s.n); break;
      case 2: RowDotLanes<2, Bits>(s, weights, xs, s.k, scales, minimums, run_group, outs, s.n); break;
      case 3: RowDotLanes<3, Bits>(s, weights, xs, s.k, scales, minimums, run_group, outs, s.n); break;
      default: RowDotLanes<4, Bits>(s, weights, xs, s.k, scales, minimums, run_group, outs, s.n);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dots = true;

// 4-bit weights times rows of x by bfloat16 dot products (vdpbf16ps: pairs
// of products added to float32 lanes). x comes as P bfloat16 pieces that sum
// to it ([P, m, k]: a bfloat16 x is its own piece; a float32 one is split in
// three, 24 bits in all, `SplitInBfloat16`). The integers 0..15 times a
// piece are exact, so per group the sum is scale * dot(ints, x) +
// minimum * sum(x) in float32, with each group's x sums (`x_sums`,
// [m, groups]) computed once per call. A run of 32 bytes gives 32 inputs of
// each half; each group lies in one half (`InBf16Runs`).
template <int64_t M, int64_t P>
void RowDotBf16(const Shapes& s, const uint8_t* weights, const uint16_t* x, const float* x_sums,
                const float* scales, const float* minimums, float* out) {
  const int64_t half = s.k / 2, per_half = half / s.group_size, runs = s.group_size / 32;
  alignas(64) static constexpr uint16_t levels[32] = {  // bfloat16 bits of 0.0 .. 15.0
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(levels), low_nibble = _mm512_set1_epi16(0x0F);
  __m512 acc[2][M][2];  // [group parity][row][half]
  for (auto& parity : acc) {
    for (auto& row : parity) row[0] = row[1] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < per_half; ++g) {
    __m512 dot[P][M][2];  // a sum per piece: independent adds
    for (auto& piece : dot) {
      for (auto& row : piece) row[0] = row[1] = _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t c = g * s.group_size + r * 32;
      __m512i words = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + c)));
      __m512bh ints[2] = {
          (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, low_nibble), table),
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table)};
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t h = 0; h < 2; ++h) {
            const uint16_t* xs = x + (p * s.m + i) * s.k + h * half + c;
            dot[p][i][h] = _mm512_dpbf16_ps(dot[p][i][h], ints[h], (__m512bh)_mm512_loadu_si512(xs));
          }
        }
      }
    }
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t h = 0; h < 2; ++h) {
        __m512 sum = dot[0][i][h];
        for (int64_t p = 1; p < P; ++p) sum = _mm512_add_ps(sum, dot[p][i][h]);
        __m512 scale = _mm512_set1_ps(scales[g + h * per_half]);
        acc[g & 1][i][h] = _mm512_fmadd_ps(scale, sum, acc[g & 1][i][h]);
      }
    }
  }
  const int64_t groups = s.groups();
  for (int64_t i = 0; i < M; ++i) {
    __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0][i][0], acc[0][i][1]),
                                 _mm512_add_ps(acc[1][i][0], acc[1][i][1]));
    float shift = 0.0f;
    if (minimums != nullptr) {
#pragma omp simd reduction(+ : shift)
      for (int64_t g = 0; g < groups; ++g) shift += minimums[g] * x_sums[i * groups + g];
    }
    out[i * s.n] = _mm512_reduce_add_ps(total) + shift;
  }
}

// Rows of x two at a time (one bfloat16 piece) or one at a time (three):
// more at once spill registers.
void RowDotBf16Rows(const Shapes& s, int64_t pieces, const uint8_t* weights, const uint16_t* x,
                    const float* x_sums, const float* scales, const float* minimums, float* out) {
  const int64_t groups = s.groups();
  for (int64_t i = 0; i < s.m;) {
    const uint16_t* xs = x + i * s.k;
    const float* sums = x_sums + i * groups;
    float* outs = out + i * s.n;
    if (pieces == 3) {
      RowDotBf16<1, 3>(s, weights, xs, sums, scales, minimums, outs);
      i += 1;
    } else if (i + 1 < s.m) {
      RowDotBf16<2, 1>(s, weights, xs, sums, scales, minimums, outs);
      i += 2;
    } else {
      RowDotBf16<1, 1>(s, weights, xs, sums, scales, minimums, outs);
      i += 1;
    }
  }
}
#else
constexpr bool kBf16Dots = false;
#endif

// Whether 4-bit weights take `RowDotBf16`: this CPU has bfloat16 dot
// products and runs of 32 bytes lie in one group of one half.
bool InBf16Runs(const Shapes& s) {
  const int64_t half = s.k / 2;
  return kBf16Dots && s.bits == 4 && half % 32 == 0 && s.group_size % 32 == 0 &&
         half % s.group_size == 0;
}

struct Operands {
  const float* x;  // float32 [m, k]
  const void* values;
  const void* scales;
  const void* minimums;  // nullptr: none
  bool half_scales, half_minimums;
  const int32_t* run_group;  // group of each run of 16 inputs
  float* out;  // [m, n]
  const uint16_t* x_bf16;  // x as bfloat16 pieces where `RowDotBf16` serves, else nullptr
  int64_t x_pieces;  // how many: [x_pieces, m, k]
  const float* x_sums;  // [m, groups]: x summed per group, for `RowDotBf16`
};

template <int Bits>
void MultiplyAll(const Shapes& s, const Operands& o, ffi::ThreadPool pool) {
  const int64_t items = (s.n + kOutputsPerItem - 1) / kOutputsPerItem;
  std::vector<float> groups;  // each thread's own copy: the item's scales and minimums
  paged_jax::ShareItems(pool, items, [=](int64_t item) mutable {
    const int64_t g = s.groups(), first = item * kOutputsPerItem;
    const int64_t rows = std::min(s.n, first + kOutputsPerItem) - first;
    groups.resize(2 * rows * g);
    float* all_minimums = o.minimums == nullptr ? nullptr : groups.data() + rows * g;
    GroupsAsFloat(o.scales, o.half_scales, first, rows, g, groups.data());
    if (all_minimums) GroupsAsFloat(o.minimums, o.half_minimums, first, rows, g, all_minimums);
    for (int64_t r = first; r < first + rows; ++r) {
      const float* scales = groups.data() + (r - first) * g;
      const float* minimums = all_minimums ? all_minimums + (r - first) * g : nullptr;
      const void* row = static_cast<const uint8_t*>(o.values) + r * s.stored();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (o.x_bf16 != nullptr) {
        RowDotBf16Rows(s, o.x_pieces, static_cast<const uint8_t*>(row), o.x_bf16, o.x_sums,
                       scales, minimums, o.out + r);
        continue;
      }
#endif
      RowDot<Bits>(s, row, o.x, s.m, scales, minimums, o.run_group, o.out + r);
    }
  });
}

// Three bfloat16 pieces [3, count] that sum to float32 `x` (each piece the
// rounding of what the ones before leave: 24 bits in all; inf and NaN are
// their first piece).
std::vector<uint16_t> SplitInBfloat16(const float* x, int64_t count) {
  std::vector<uint16_t> pieces(3 * count);
  for (int64_t i = 0; i < count; ++i) {
    float rest = x[i];
    for (int64_t p = 0; p < (std::isfinite(rest) ? 3 : 1); ++p) {
      paged_jax::Narrow(rest, &pieces[p * count + i]);
      rest -= Widen(pieces[p * count + i]);
    }
  }
  return pieces;
}

template <typename Dims>
bool SameShape(const Dims& a, const Dims& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

bool IsFloatGroups(ffi::DataType type) {
  return type == ffi::DataType::F16 || type == ffi::DataType::F32;
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                           ffi::AnyBuffer scales, ffi::AnyBuffer minimums,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits,
                           int64_t group_size, int64_t with_minimums) {
  auto x_dims = x.dimensions(), v_dims = values.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || v_dims.size() != 2 || s_dims.size() != 2) {
    return ffi::Error::InvalidArgument("quantized matmul: bad ranks");
  }
  Shapes s{x_dims[0], v_dims[0], x_dims[1], bits, group_size};
  auto want = bits == 4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if ((bits != 4 && bits != 8) || values.element_type() != want) {
    return ffi::Error::InvalidArgument("quantized matmul: values must be uint8 (4 bits) or int8");
  }
  if (group_size < 1 || s.k % group_size || (bits == 4 && s.k % 2) || v_dims[1] != s.stored() ||
      s_dims[0] != s.n || s_dims[1] != s.groups() ||
      (with_minimums && !SameShape(minimums.dimensions(), s_dims))) {
    return ffi::Error::InvalidArgument("quantized matmul: inconsistent shapes");
  }
  auto x_type = x.element_type();
  if ((x_type != ffi::DataType::F32 && x_type != ffi::DataType::BF16) ||
      !IsFloatGroups(scales.element_type()) ||
      (with_minimums && !IsFloatGroups(minimums.element_type()))) {
    return ffi::Error::InvalidArgument(
        "quantized matmul: x float32 or bfloat16, scales float16 or float32");
  }
  // x as float32 (and, where bfloat16 dot products serve, as bfloat16 pieces
  // and its sums per group), and the group of each run of 16 inputs.
  std::vector<float> widened, x_sums;
  std::vector<uint16_t> pieces;
  const float* xs = static_cast<const float*>(x.untyped_data());
  const uint16_t* x_bf16 = nullptr;
  if (x_type == ffi::DataType::BF16) {
    x_bf16 = static_cast<const uint16_t*>(x.untyped_data());
    widened.resize(s.m * s.k);
    for (int64_t i = 0; i < s.m * s.k; ++i) widened[i] = Widen(x_bf16[i]);
    xs = widened.data();
  } else if (InBf16Runs(s)) {
    pieces = SplitInBfloat16(xs, s.m * s.k);
    x_bf16 = pieces.data();
  }
  if (!InBf16Runs(s)) x_bf16 = nullptr;
  if (x_bf16 != nullptr) {
    x_sums.assign(s.m * s.groups(), 0.0f);
    for (int64_t i = 0; i < s.m * s.k; ++i) x_sums[i / group_size] += xs[i];
  }
  std::vector<int32_t> run_group(s.k / kLanes);
  for (int64_t j = 0; j < int64_t(run_group.size()); ++j) run_group[j] = j * kLanes / group_size;
  Operands o{xs,
             values.untyped_data(),
             scales.untyped_data(),
             with_minimums ? minimums.untyped_data() : nullptr,
             scales.element_type() == ffi::DataType::F16,
             with_minimums && minimums.element_type() == ffi::DataType::F16,
             run_group.data(),
             out->typed_data(),
             x_bf16,
             x_type == ffi::DataType::BF16 ? 1 : 3,
             x_sums.data()};
  if (bits == 4) {
    MultiplyAll<4>(s, o, pool);
  } else {
    MultiplyAll<8>(s, o, pool);
  }
  return ffi::Error::Success();
}

// The same, writing over a buffer passed in (aliased to the result), so that
// tests can fill it first and see every element the kernel does not write.
ffi::Error QuantizedMatmulInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                               ffi::AnyBuffer scales, ffi::AnyBuffer minimums, ffi::AnyBuffer,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits,
                               int64_t group_size, int64_t with_minimums) {
  return QuantizedMatmul(pool, x, values, scales, minimums, out, bits, group_size, with_minimums);
}

auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()   // x
      .Arg<ffi::AnyBuffer>()   // values
      .Arg<ffi::AnyBuffer>()   // scales
      .Arg<ffi::AnyBuffer>();  // minimums (scales again where there are none)
}

template <typename Binding>
auto BindResult(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("group_size")
      .template Attr<int64_t>("with_minimums");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulCpu, QuantizedMatmul, BindResult(BindOperands()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulIntoCpu, QuantizedMatmulInto,
                              BindResult(BindOperands().Arg<ffi::AnyBuffer>()));
