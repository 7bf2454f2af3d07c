// The steps of a decode launch on XLA:CPU, published while it runs, as FFI
// calls (paged_jax/engine/step_stream.py builds and registers them): each
// step's draws go into the launch's channel, and the host takes them from
// there before the launch ends. The last call of a launch marks its end.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChannels = 8192;  // paged_jax.engine.step_stream.MAX_CHANNELS
constexpr int32_t kEnded = -1;       // the column of a launch's end mark

struct Step {
  int32_t column;  // the step's column in the launch's draws, or kEnded
  int64_t rows = 0, k = 0;
  std::vector<int32_t> tokens, top_ids;
  std::vector<float> logprob, top_logprobs;
  std::vector<uint8_t> drew;
};

struct Channel {
  std::mutex mutex;
  std::condition_variable published;
  std::deque<Step> steps;
};

Channel channels[kChannels];

bool InRange(int64_t id) { return id >= 0 && id < kChannels; }

void Push(int64_t id, Step step) {
  Channel& channel = channels[id];
  {
    std::lock_guard<std::mutex> lock(channel.mutex);
    channel.steps.push_back(std::move(step));
  }
  channel.published.notify_all();
}

template <typename T>
std::vector<T> Copied(const T* data, int64_t n) {
  return std::vector<T>(data, data + n);
}

// `passed` comes back unchanged as the result: the loop uses it, so the
// call is not removed, and it runs once the step has computed it.
ffi::Error PublishStepImpl(ffi::Buffer<ffi::S32> channel, ffi::Buffer<ffi::S32> column,
                           ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::F32> logprob,
                           ffi::Buffer<ffi::S32> top_ids, ffi::Buffer<ffi::F32> top_logprobs,
                           ffi::Buffer<ffi::PRED> drew, ffi::Buffer<ffi::PRED> passed,
                           ffi::ResultBuffer<ffi::PRED> out) {
  const int64_t id = channel.typed_data()[0];
  if (!InRange(id)) return ffi::Error::InvalidArgument("step stream channel out of range");
  Step step{column.typed_data()[0]};
  step.rows = tokens.element_count();
  step.k = step.rows ? top_ids.element_count() / step.rows : 0;
  step.tokens = Copied(tokens.typed_data(), step.rows);
  step.logprob = Copied(logprob.typed_data(), step.rows);
  step.top_ids = Copied(top_ids.typed_data(), step.rows * step.k);
  step.top_logprobs = Copied(top_logprobs.typed_data(), step.rows * step.k);
  const bool* drawn = drew.typed_data();
  step.drew.assign(drawn, drawn + step.rows);
  Push(id, std::move(step));
  out->typed_data()[0] = passed.typed_data()[0];
  return ffi::Error::Success();
}

// `steps` comes back unchanged, as `passed` above.
ffi::Error EndLaunchImpl(ffi::Buffer<ffi::S32> channel, ffi::Buffer<ffi::S32> steps,
                         ffi::ResultBuffer<ffi::S32> out) {
  const int64_t id = channel.typed_data()[0];
  if (!InRange(id)) return ffi::Error::InvalidArgument("step stream channel out of range");
  Push(id, Step{kEnded});
  out->typed_data()[0] = steps.typed_data()[0];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PublishStepCpu, PublishStepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EndLaunchCpu, EndLaunchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Takes up to `capacity` published steps of channel `id` into the host's
// arrays (`rows` rows and `k` alternatives each), waiting up to
// `timeout_us` for the first. Returns how many it took; -1 for an id out of
// range, -2 when a step's shape is not `rows` x `k` (it stays published).
extern "C" int32_t paged_jax_take_steps(int64_t id, int64_t rows, int64_t k, int32_t capacity,
                                        int64_t timeout_us, int32_t* columns, int32_t* tokens,
                                        float* logprob, int32_t* top_ids, float* top_logprobs,
                                        uint8_t* drew) {
  if (!InRange(id)) return -1;
  Channel& channel = channels[id];
  std::unique_lock<std::mutex> lock(channel.mutex);
  channel.published.wait_for(lock, std::chrono::microseconds(timeout_us),
                             [&] { return !channel.steps.empty(); });
  int32_t taken = 0;
  while (taken < capacity && !channel.steps.empty()) {
    const Step& step = channel.steps.front();
    columns[taken] = step.column;
    if (step.column != kEnded) {
      if (step.rows != rows || step.k != k) return taken ? taken : -2;
      std::copy(step.tokens.begin(), step.tokens.end(), tokens + taken * rows);
      std::copy(step.logprob.begin(), step.logprob.end(), logprob + taken * rows);
      std::copy(step.top_ids.begin(), step.top_ids.end(), top_ids + taken * rows * k);
      std::copy(step.top_logprobs.begin(), step.top_logprobs.end(),
                top_logprobs + taken * rows * k);
      std::copy(step.drew.begin(), step.drew.end(), drew + taken * rows);
    }
    channel.steps.pop_front();
    ++taken;
  }
  return taken;
}

// Drops whatever channel `id` holds (a launch about to use it starts empty).
extern "C" void paged_jax_clear_steps(int64_t id) {
  if (!InRange(id)) return;
  std::lock_guard<std::mutex> lock(channels[id].mutex);
  channels[id].steps.clear();
}
