// Arrival flags that a decode launch on XLA:CPU reads before each step, as
// an FFI call (paged_jax/engine/arrivals.py builds and registers it): one
// flag per engine, set and cleared by the host through the exported C
// functions, read by the loop without a round trip through Python.

#include <atomic>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kWatches = 4096;  // paged_jax.engine.arrivals.MAX_WATCHES
std::atomic<int32_t> arrived[kWatches];

// `after` is not read: as an operand it orders the read after its computation.
ffi::Error ArrivedImpl(ffi::Buffer<ffi::S32> watch, ffi::AnyBuffer after,
                       ffi::ResultBuffer<ffi::PRED> out) {
  const int64_t id = watch.typed_data()[0];
  if (id < 0 || id >= kWatches) {
    return ffi::Error::InvalidArgument("arrival watch id out of range");
  }
  out->typed_data()[0] = arrived[id].load(std::memory_order_acquire) != 0;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArrivedCpu, ArrivedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

extern "C" void paged_jax_set_arrived(int64_t id, int32_t value) {
  if (id >= 0 && id < kWatches) arrived[id].store(value, std::memory_order_release);
}
