// Paged attention for XLA:CPU, called through JAX's FFI
// (pallas_kernels/paged_attention/cpu.py builds and registers it): decode
// (one query token per sequence) and prefill (several new tokens per
// sequence, causal: a prompt chunk or a ragged step's tile).
//
// Grouped-query heads. A decode work item is one query token and one KV head:
// its keys are read page by page through the block table, straight from the
// cache (nothing is gathered into a copy), the logits of the group's query
// heads go to a scratch row, then a softmax and the weighted sum of the
// values. A prefill work item is a block of consecutive query tokens of one
// sequence and one KV head: each 16 keys are read once for the block, turned
// so that a query's 16 logits are one vector of multiply-adds, and an online
// softmax carries each query's running maximum, total and sum (head sizes of
// 64, 128 or 256 and pages of a multiple of 16 keys; other shapes take the
// decode item per token). Items are shared between the calling thread and
// the tasks it schedules on XLA's intra-op thread pool.
//
// Semantics are those of the XLA reference: a key is visible when its
// position is below the query's context length (the sequence's length for a
// decode token; its own position + 1 for a prefill token) and inside the
// sliding window, and its table entry holds a block; a token with no visible
// key gives zeros. Pages are float32 or bfloat16 (bits read as uint16); sums
// run in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paged_jax;  // NOLINT: the kernels' shared pieces (cpu_simd.h)

// exp(x) for x <= 0, 16 at a time (Cephes' polynomial, about 1 ulp); 0 below
// -87 (and for -inf), NaN kept.
inline Lanes ExpNonPositive(Lanes x) {
  IntLanes tiny = x < -87.0f;  // -1 where true; vector casts keep the bits
  Lanes clamped = (Lanes)(((IntLanes)x & ~tiny) | ((IntLanes)(Lanes{} - 87.0f) & tiny));
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  Lanes n = (clamped * 1.44269504088896341f + round) - round;
  Lanes r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  IntLanes two_n = (__builtin_convertvector(n, IntLanes) + 127) << 23;
  return (Lanes)((IntLanes)(p * (Lanes)two_n) & ~tiny);
}

// Head sizes a multiple of the lanes, known at compile time, run the
// vector-extension loops; other sizes plain loops.
template <int64_t D>
constexpr bool kInLanes = D > 0 && D % kLanes == 0;

// logits[g * stride + t] = queries[g] . rows[t] for t in [lo, hi).
template <typename T, int64_t D>
void DotRows(const float* queries, const T* rows, int64_t d, int64_t group, int64_t lo,
             int64_t hi, float* logits, int64_t stride) {
  if constexpr (kInLanes<D>) {  // a row in registers, reused by the group
    constexpr int64_t kChunks = D / kLanes;
    for (int64_t t = lo; t < hi; ++t) {
      Lanes row[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) row[c] = LoadWide(rows + t * D + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        Lanes dot = row[0] * Load<Lanes>(queries + g * D);
        for (int64_t c = 1; c < kChunks; ++c) {
          dot += row[c] * Load<Lanes>(queries + g * D + c * kLanes);
        }
        logits[g * stride + t] = Sum(dot);
      }
    }
  } else {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t = lo; t < hi; ++t) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += queries[g * d + i] * Widen(rows[t * d + i]);
        logits[g * stride + t] = dot;
      }
    }
  }
}

// sums[g] += weights[g * stride + t] * rows[t] for t in [lo, hi).
template <typename T, int64_t D>
void AccumulateRows(const float* weights, const T* rows, int64_t d, int64_t group, int64_t lo,
                    int64_t hi, int64_t stride, float* sums) {
  for (int64_t g = 0; g < group; ++g) {
    if constexpr (kInLanes<D>) {  // the sum in registers across the rows
      constexpr int64_t kChunks = D / kLanes;
      Lanes sum[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) sum[c] = Load<Lanes>(sums + g * D + c * kLanes);
      for (int64_t t = lo; t < hi; ++t) {
        float w = weights[g * stride + t];
        for (int64_t c = 0; c < kChunks; ++c) sum[c] += w * LoadWide(rows + t * D + c * kLanes);
      }
      for (int64_t c = 0; c < kChunks; ++c) Store(sums + g * D + c * kLanes, sum[c]);
    } else {
      for (int64_t t = lo; t < hi; ++t) {
        float w = weights[g * stride + t];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) sums[g * d + i] += w * Widen(rows[t * d + i]);
      }
    }
  }
}

struct Shapes {
  int64_t batch, num_q_heads, head_dim, num_kv_heads, num_blocks, block_size, max_blocks;
  int64_t group() const { return num_q_heads / num_kv_heads; }
};

struct Options {
  float scale;
  float soft_cap;  // 0: none
  int64_t sliding_window;  // 0: none
};

// Attention of one token's query heads of KV head `head` (`q_rows`, the
// group's `[group, d]` queries; `out_rows` likewise) to the `length` first
// positions of the sequence whose block table is `table`. `D` is the head
// size when known at compile time (its loops then unroll into registers),
// else 0 and the shapes' head_dim serves.
template <typename T, int64_t D>
void AttendItem(const Shapes& s, const Options& o, const T* q_rows, const T* k, const T* v,
                const int32_t* table, int64_t length, T* out_rows, int64_t head,
                std::vector<float>& scratch) {
  const int64_t d = D > 0 ? D : s.head_dim, group = s.group(), bs = s.block_size;
  int64_t first = o.sliding_window > 0 ? std::max<int64_t>(0, length - o.sliding_window) : 0;
  length = std::min<int64_t>(length, s.max_blocks * bs);  // no key past the table
  int64_t count = length - first;
  int64_t stride = (count + kLanes - 1) / kLanes * kLanes;  // a group's logits, padded
  if (count <= 0) {
    for (int64_t i = 0; i < group * d; ++i) Narrow(0.0f, out_rows + i);
    return;
  }
  // scratch: queries [group, d], sums [group, d], totals [group],
  // logits [group, stride] (-inf past count)
  scratch.resize(group * d + group * d + group + group * stride);
  float* queries = scratch.data();
  float* sums = queries + group * d;
  float* totals = sums + group * d;
  float* logits = totals + group;
  for (int64_t i = 0; i < group * d; ++i) queries[i] = Widen(q_rows[i]) * o.scale;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  auto page = [&](const T* pages, int64_t block) -> const T* {
    int32_t entry = table[block];
    if (entry < 0) return nullptr;
    int64_t clamped = std::min<int64_t>(entry, s.num_blocks - 1);
    return pages + (head * s.num_blocks + clamped) * bs * d;
  };
  auto prefetch_page = [&](const T* pages, int64_t block) {
    if (block * bs >= length) return;
    const T* next = page(pages, block);
    if (next == nullptr) return;
    for (int64_t byte = 0; byte < bs * d * int64_t(sizeof(T)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(next) + byte);
    }
  };

  // Logits, page by page; -inf where the table holds no block.
  for (int64_t block = first / bs; block * bs < length; ++block) {
    int64_t lo = std::max(first, block * bs) - block * bs;
    int64_t hi = std::min(length, (block + 1) * bs) - block * bs;
    float* block_logits = logits + block * bs - first;
    const T* keys = page(k, block);
    prefetch_page(k, block + 1);
    if (keys == nullptr) {
      for (int64_t g = 0; g < group; ++g) {
        std::fill(block_logits + g * stride + lo, block_logits + g * stride + hi, neg_inf);
      }
      continue;
    }
    DotRows<T, D>(queries, keys, d, group, lo, hi, block_logits, stride);
    for (int64_t g = 0; g < group; ++g) {
      if (o.soft_cap > 0) {  // on the keys read only: masked ones stay -inf
        for (int64_t t = lo; t < hi; ++t) {
          float& logit = block_logits[g * stride + t];
          logit = o.soft_cap * std::tanh(logit / o.soft_cap);
        }
      }
    }
  }

  // Softmax weights, unnormalized; the totals divide at the end.
  bool any_visible = false;
  for (int64_t g = 0; g < group; ++g) {
    float* row_logits = logits + g * stride;
    std::fill(row_logits + count, row_logits + stride, neg_inf);
    float most = neg_inf;
#pragma omp simd reduction(max : most)
    for (int64_t i = 0; i < count; ++i) most = std::max(most, row_logits[i]);
    totals[g] = 0.0f;
    if (most == neg_inf) continue;
    any_visible = true;
    Lanes total = {};
    for (int64_t i = 0; i < stride; i += kLanes) {
      Lanes w = ExpNonPositive(Load<Lanes>(row_logits + i) - most);
      Store(row_logits + i, w);
      total += w;
    }
    totals[g] = Sum(total);
  }
  std::fill(sums, sums + group * d, 0.0f);
  for (int64_t block = first / bs; any_visible && block * bs < length; ++block) {
    const T* values = page(v, block);
    prefetch_page(v, block + 1);
    if (values == nullptr) continue;
    int64_t lo = std::max(first, block * bs) - block * bs;
    int64_t hi = std::min(length, (block + 1) * bs) - block * bs;
    const float* block_weights = logits + block * bs - first;
    AccumulateRows<T, D>(block_weights, values, d, group, lo, hi, stride, sums);
  }
  for (int64_t g = 0; g < group; ++g) {
    float inverse = totals[g] == 0.0f ? 0.0f : 1.0f / totals[g];
    for (int64_t i = 0; i < d; ++i) Narrow(sums[g * d + i] * inverse, out_rows + g * d + i);
  }
}

// The largest lane of `v`.
inline float Max(Lanes v) {
  float most = v[0];
  for (int64_t i = 1; i < kLanes; ++i) most = std::max(most, v[i]);
  return most;
}

// Query tokens per prefill work item, and query rows whose logits are
// computed together.
constexpr int64_t kQueryBlock = 16;
constexpr int64_t kRowTile = 4;
constexpr int64_t kChunkTile = 4;  // of 16 lanes: D = 64, 128, 256 hold whole tiles

// One row's online softmax over 16 more keys: `logits` of keys whose lanes
// from `start` on and below `stop` are visible (the rest hidden), the row's
// running `maximum` and `total` updated, `rescale` the factor its sums take;
// returns the keys' weights (zeros where hidden; all zeros, the row
// unchanged, when it sees no finite logit yet).
inline Lanes UpdateSoftmax(const Options& o, Lanes logits, int64_t start, int64_t stop,
                           float& maximum, float& total, float& rescale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; o.soft_cap > 0 && t < kLanes; ++t) {
    logits[t] = o.soft_cap * std::tanh(logits[t] / o.soft_cap);
  }
  IntLanes lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = static_cast<int32_t>(i);
  IntLanes hidden = (lane < static_cast<int32_t>(start)) | (lane >= static_cast<int32_t>(stop));
  logits = (Lanes)(((IntLanes)logits & ~hidden) | ((IntLanes)(Lanes{} + neg_inf) & hidden));
  float most = std::max(maximum, Max(logits));
  if (most == neg_inf) return Lanes{};  // NaN goes on, as in the per-token softmax
  rescale = maximum == neg_inf ? 0.0f : std::exp(maximum - most);
  maximum = most;
  Lanes weights = ExpNonPositive(logits - most);
  total = total * rescale + Sum(weights);
  return weights;
}

// A prefill block: `count` consecutive query tokens of one sequence (`q_rows`
// the first token's `[group, D]` queries, the next token's `token_stride`
// elements on; `out_rows` likewise) for KV head `head`; the first token sees
// `first_length` positions, each next one one more. Same semantics as
// `AttendItem` per token.
template <typename T, int64_t D>
void AttendBlock(const Shapes& s, const Options& o, const T* q_rows, int64_t token_stride,
                 const T* k, const T* v, const int32_t* table, int64_t first_length,
                 int64_t count, T* out_rows, int64_t head, std::vector<float>& scratch,
                 std::vector<int64_t>& lanes) {
  static_assert(kInLanes<D> && D / kLanes % kChunkTile == 0);
  constexpr int64_t kChunks = D / kLanes;
  const int64_t group = s.group(), rows = count * group, bs = s.block_size;
  const int64_t capacity = s.max_blocks * bs;  // no key past the table
  const int64_t window = o.sliding_window;
  const int64_t padded = (rows + kRowTile - 1) / kRowTile * kRowTile;
  // scratch: queries [padded, D] (zeros past rows), sums [padded, D],
  // turned keys [D, kLanes], logits (then weights) [padded, kLanes], maxima,
  // totals and rescales [padded]; the rows' key lanes in `lanes`
  scratch.resize(2 * padded * D + D * kLanes + padded * kLanes + 3 * padded);
  lanes.resize(2 * padded);
  int64_t* starts = lanes.data();
  int64_t* stops = starts + padded;
  float* queries = scratch.data();
  float* sums = queries + padded * D;
  float* turned = sums + padded * D;
  float* logits = turned + D * kLanes;
  float* maxima = logits + padded * kLanes;
  float* totals = maxima + padded;
  float* rescales = totals + padded;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const T* query = q_rows + (r / group) * token_stride + (r % group) * D;
    for (int64_t i = 0; i < D; ++i) queries[r * D + i] = Widen(query[i]) * o.scale;
  }
  std::fill(queries + rows * D, queries + padded * D, 0.0f);
  std::fill(sums, sums + padded * D, 0.0f);
  std::fill(maxima, maxima + padded, neg_inf);
  std::fill(totals, totals + padded, 0.0f);
  const int64_t last_length = std::min(first_length + count - 1, capacity);
  const int64_t start = window > 0 ? std::max<int64_t>(0, first_length - window) : 0;
  for (int64_t key = start / kLanes * kLanes; key < last_length; key += kLanes) {
    int32_t entry = table[key / bs];
    if (entry < 0) continue;  // no block: its keys stay invisible
    int64_t block = std::min<int64_t>(entry, s.num_blocks - 1);
    int64_t offset = ((head * s.num_blocks + block) * bs + key % bs) * D;
    const T* keys = k + offset;
    const T* values = v + offset;
    for (int64_t t = 0; t < kLanes; ++t) {
      for (int64_t i = 0; i < D; ++i) turned[i * kLanes + t] = Widen(keys[t * D + i]);
    }
    for (int64_t r = 0; r < padded; r += kRowTile) {  // kRowTile rows share each load
      Lanes tile[kRowTile] = {};
      for (int64_t i = 0; i < D; ++i) {
        Lanes column = Load<Lanes>(turned + i * kLanes);
        for (int64_t j = 0; j < kRowTile; ++j) tile[j] += queries[(r + j) * D + i] * column;
      }
      for (int64_t j = 0; j < kRowTile; ++j) Store(logits + (r + j) * kLanes, tile[j]);
    }
    // Each row's weights (zeros where hidden), the factor of its sums, and
    // the keys it sees: lanes [starts[r], stops[r]).
    for (int64_t r = 0; r < padded; ++r) {
      int64_t length = std::min(first_length + r / group, capacity);
      int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      rescales[r] = 1.0f;
      starts[r] = stops[r] = 0;
      Lanes weights = {};
      if (r < rows && key < length && key + kLanes > first) {
        starts[r] = std::max(first, key) - key;
        stops[r] = std::min(length, key + kLanes) - key;
        weights = UpdateSoftmax(o, Load<Lanes>(logits + r * kLanes), starts[r], stops[r],
                                maxima[r], totals[r], rescales[r]);
      }
      Store(logits + r * kLanes, weights);
    }
    // sums = rescale * sums + weights @ values, kRowTile rows and kChunkTile
    // chunks of D at a time, each value row read once per tile and added to
    // the rows that see it only (a hidden value may be any bits, NaN
    // included, and a zero weight would not keep a NaN out).
    for (int64_t r = 0; r < padded; r += kRowTile) {
      const int64_t* tile_starts = starts + r;
      const int64_t* tile_stops = stops + r;
      int64_t lo = *std::min_element(tile_starts, tile_starts + kRowTile);
      int64_t hi = *std::max_element(tile_stops, tile_stops + kRowTile);
      for (int64_t c0 = 0; c0 < kChunks; c0 += kChunkTile) {
        Lanes sum[kRowTile][kChunkTile];
        for (int64_t j = 0; j < kRowTile; ++j) {
          for (int64_t c = 0; c < kChunkTile; ++c) {
            sum[j][c] = rescales[r + j] * Load<Lanes>(sums + (r + j) * D + (c0 + c) * kLanes);
          }
        }
        for (int64_t t = lo; t < hi; ++t) {
          Lanes row[kChunkTile];
          for (int64_t c = 0; c < kChunkTile; ++c) {
            row[c] = LoadWide(values + t * D + (c0 + c) * kLanes);
          }
          for (int64_t j = 0; j < kRowTile; ++j) {
            if (t < tile_starts[j] || t >= tile_stops[j]) continue;
            float weight = logits[(r + j) * kLanes + t];
            for (int64_t c = 0; c < kChunkTile; ++c) sum[j][c] += weight * row[c];
          }
        }
        for (int64_t j = 0; j < kRowTile; ++j) {
          for (int64_t c = 0; c < kChunkTile; ++c) {
            Store(sums + (r + j) * D + (c0 + c) * kLanes, sum[j][c]);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float inverse = totals[r] == 0.0f ? 0.0f : 1.0f / totals[r];
    T* out = out_rows + (r / group) * token_stride + (r % group) * D;
    for (int64_t i = 0; i < D; ++i) Narrow(sums[r * D + i] * inverse, out + i);
  }
}

template <typename T>
auto AttendFor(int64_t head_dim) {
  return head_dim == 64 ? AttendItem<T, 64>
         : head_dim == 128 ? AttendItem<T, 128>
         : head_dim == 256 ? AttendItem<T, 256>
                           : AttendItem<T, 0>;
}

// Decode: items (row, KV head) shared by the calling thread and the pool's
// threads.
template <typename T>
void AttendAll(const Shapes& s, const Options& o, const T* q, const T* k, const T* v,
               const int32_t* tables, const int32_t* lengths, T* out, ffi::ThreadPool pool) {
  auto attend = AttendFor<T>(s.head_dim);
  std::vector<float> scratch;  // each thread's own copy
  paged_jax::ShareItems(pool, s.batch * s.num_kv_heads, [=](int64_t item) mutable {
    int64_t row = item / s.num_kv_heads, head = item % s.num_kv_heads;
    int64_t offset = (row * s.num_q_heads + head * s.group()) * s.head_dim;
    attend(s, o, q + offset, k, v, tables + row * s.max_blocks, lengths[row], out + offset, head,
           scratch);
  });
}

// The prefill block for head size `head_dim`, or nullptr where it does not
// serve the shapes (the head size or a page size not a multiple of 16).
template <typename T>
auto AttendBlockFor(const Shapes& s) {
  using Block = decltype(&AttendBlock<T, 64>);
  if (s.block_size % kLanes != 0) return Block(nullptr);
  return s.head_dim == 64    ? AttendBlock<T, 64>
         : s.head_dim == 128 ? AttendBlock<T, 128>
         : s.head_dim == 256 ? AttendBlock<T, 256>
                             : Block(nullptr);
}

// Prefill: items (sequence, KV head, block of query tokens), the blocks of
// one sequence and head in a row (one token per item where `AttendBlockFor`
// has no block). Token `i` of sequence `b` is at position `lengths[b] -
// query_lens[b] + i`; tokens from `query_lens[b]` on are padding and give
// zeros.
template <typename T>
void AttendQueries(const Shapes& s, int64_t num_queries, const Options& o, const T* q,
                   const T* k, const T* v, const int32_t* tables, const int32_t* lengths,
                   const int32_t* query_lens, T* out, ffi::ThreadPool pool) {
  auto attend = AttendFor<T>(s.head_dim);
  auto attend_block = AttendBlockFor<T>(s);
  const int64_t per_item = attend_block == nullptr ? 1 : kQueryBlock;
  const int64_t blocks = (num_queries + per_item - 1) / per_item;
  const int64_t token_stride = s.num_q_heads * s.head_dim;
  std::vector<float> scratch;  // each thread's own copies
  std::vector<int64_t> lanes;
  int64_t items = s.batch * s.num_kv_heads * blocks;
  paged_jax::ShareItems(pool, items, [=](int64_t item) mutable {
    int64_t first_token = item % blocks * per_item, head = item / blocks % s.num_kv_heads;
    int64_t row = item / (blocks * s.num_kv_heads);
    int64_t count = std::min(per_item, num_queries - first_token);
    int64_t offset =
        (row * num_queries + first_token) * token_stride + head * s.group() * s.head_dim;
    int64_t new_tokens = std::max<int32_t>(query_lens[row], 0);
    int64_t first_length = lengths[row] - new_tokens + first_token + 1;
    int64_t attending = std::clamp<int64_t>(new_tokens - first_token, 0, count);
    const int32_t* table = tables + row * s.max_blocks;
    if (attend_block != nullptr && attending > 0) {
      attend_block(s, o, q + offset, token_stride, k, v, table, first_length, attending,
                   out + offset, head, scratch, lanes);
    }
    for (int64_t token = attend_block == nullptr ? 0 : attending; token < count; ++token) {
      int64_t length = token < attending ? first_length + token : 0;  // 0: padding, zeros
      attend(s, o, q + offset + token * token_stride, k, v, table, length,
             out + offset + token * token_stride, head, scratch);
    }
  });
}

// Runs `attend(q, k, v, out)` on the buffers as float32 or bfloat16 bits,
// once their dtypes are checked: pages of the queries' dtype (bfloat16 pages
// may come as their bits, uint16, as the CPU cache stores them).
template <typename Attend>
ffi::Error WithTypedBuffers(const char* name, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Result<ffi::AnyBuffer>& out,
                            Attend attend) {
  auto dtype = q.element_type();
  auto page_dtype_ok = [&](ffi::DataType page) {
    return page == dtype || (dtype == ffi::DataType::BF16 && page == ffi::DataType::U16);
  };
  if (!page_dtype_ok(k_pages.element_type()) || !page_dtype_ok(v_pages.element_type()) ||
      out->element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(name) + ": mixed dtypes");
  }
  if (dtype == ffi::DataType::F32) {
    attend(static_cast<const float*>(q.untyped_data()),
           static_cast<const float*>(k_pages.untyped_data()),
           static_cast<const float*>(v_pages.untyped_data()),
           static_cast<float*>(out->untyped_data()));
  } else if (dtype == ffi::DataType::BF16) {
    attend(static_cast<const uint16_t*>(q.untyped_data()),
           static_cast<const uint16_t*>(k_pages.untyped_data()),
           static_cast<const uint16_t*>(v_pages.untyped_data()),
           static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument(std::string(name) + ": float32 or bfloat16 only");
  }
  return ffi::Error::Success();
}

// The shapes of a call whose queries have `query_rank` axes (3: decode's
// `[batch, heads, d]`; 4: prefill's `[batch, tokens, heads, d]`) into `s`,
// or an error naming the kernel.
ffi::Error ReadShapes(const char* name, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                      ffi::Buffer<ffi::S32> block_tables, size_t query_rank, Shapes& s) {
  auto q_dims = q.dimensions();
  auto k_dims = k_pages.dimensions();
  auto t_dims = block_tables.dimensions();
  if (q_dims.size() != query_rank || k_dims.size() != 4 || t_dims.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(name) + ": bad ranks");
  }
  size_t heads = query_rank - 2;
  s = Shapes{q_dims[0], q_dims[heads], q_dims[heads + 1], k_dims[0], k_dims[1], k_dims[2],
             t_dims[1]};
  if (k_dims[3] != s.head_dim || s.num_q_heads % s.num_kv_heads != 0 || t_dims[0] != s.batch) {
    return ffi::Error::InvalidArgument(std::string(name) + ": inconsistent shapes");
  }
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                float scale, float soft_cap, int64_t sliding_window) {
  const char* name = "paged decode attention";
  Shapes s{};
  if (auto error = ReadShapes(name, q, k_pages, block_tables, 3, s); error.failure()) {
    return error;
  }
  Options o{scale, soft_cap, sliding_window};
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = lengths.typed_data();
  return WithTypedBuffers(name, q, k_pages, v_pages, out, [&](auto q, auto k, auto v, auto out) {
    AttendAll(s, o, q, k, v, tables, lens, out, pool);
  });
}

ffi::Error PagedPrefillAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                 ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> query_lens,
                                 ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap,
                                 int64_t sliding_window) {
  const char* name = "paged prefill attention";
  Shapes s{};
  if (auto error = ReadShapes(name, q, k_pages, block_tables, 4, s); error.failure()) {
    return error;
  }
  int64_t num_queries = q.dimensions()[1];
  Options o{scale, soft_cap, sliding_window};
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = lengths.typed_data();
  const int32_t* new_tokens = query_lens.typed_data();
  return WithTypedBuffers(name, q, k_pages, v_pages, out, [&](auto q, auto k, auto v, auto out) {
    AttendQueries(s, num_queries, o, q, k, v, tables, lens, new_tokens, out, pool);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeAttentionCpu, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedPrefillAttentionCpu, PagedPrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
