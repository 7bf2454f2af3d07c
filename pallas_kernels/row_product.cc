// One bfloat16 row times a bfloat16 weight stored [n, k] (x @ w.T), summed in
// float32, on XLA:CPU, called through JAX's FFI (pallas_kernels/row_product.py
// builds and registers it).
//
// Each weight row is read once, 16 weights at a time widened to float32 in
// registers and multiplied with x (widened once per call); four accumulators
// keep the adds independent. Runs of output rows are shared between the
// calling thread and XLA's intra-op thread pool. Rows whose k is not a
// multiple of 16 finish in a plain loop.

#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paged_jax;  // NOLINT: the kernels' shared pieces (cpu_simd.h)

constexpr int64_t kOutputsPerItem = 64;

float RowDot(const uint16_t* w, const float* x, int64_t k) {
  Lanes acc[4] = {};
  int64_t c = 0;
  for (; c + 4 * kLanes <= k; c += 4 * kLanes) {
    for (int64_t a = 0; a < 4; ++a) {
      acc[a] += LoadWide(w + c + a * kLanes) * LoadWide(x + c + a * kLanes);
    }
  }
  for (; c + kLanes <= k; c += kLanes) acc[0] += LoadWide(w + c) * LoadWide(x + c);
  float sum = Sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; c < k; ++c) sum += Widen(w[c]) * x[c];
  return sum;
}

ffi::Error RowProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || x_dims[0] != 1 || w_dims.size() != 2 || w_dims[1] != x_dims[1]) {
    return ffi::Error::InvalidArgument("row product: x must be [1, k] and w [n, k]");
  }
  const int64_t n = w_dims[0], k = w_dims[1];
  const uint16_t* x_bits = reinterpret_cast<const uint16_t*>(x.typed_data());
  std::vector<float> xs(k);
  for (int64_t c = 0; c < k; ++c) xs[c] = Widen(x_bits[c]);
  const uint16_t* weights = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* y = out->typed_data();
  const int64_t items = (n + kOutputsPerItem - 1) / kOutputsPerItem;
  ShareItems(pool, items, [&](int64_t item) {
    const int64_t end = std::min(n, (item + 1) * kOutputsPerItem);
    for (int64_t r = item * kOutputsPerItem; r < end; ++r) y[r] = RowDot(weights + r * k, xs.data(), k);
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
      .Arg<ffi::Buffer<ffi::BF16>>()   // x [1, k]
      .Arg<ffi::Buffer<ffi::BF16>>();  // w [n, k]
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowProductCpu, RowProduct,
                              BindOperands().Ret<ffi::Buffer<ffi::F32>>());  // [1, n]
XLA_FFI_DEFINE_HANDLER_SYMBOL(RowProductIntoCpu, RowProductInto,
                              BindOperands().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());
