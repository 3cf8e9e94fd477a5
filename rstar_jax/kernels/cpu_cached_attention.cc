// Attention over a stacked KV cache read in place, for XLA:CPU decoding (issue 26 item 4): one XLA FFI handler,
// float32, the arithmetic of rstar_jax/model/attention.py:cached_attention.
//
// XLA:CPU hands a dot only dense operands, so reading one layer's first `window` cache positions out of the stacked
// [L, B, Hkv, S, D] cache inside the layer scan copied them (keys and values, every layer of every decode step: a
// third of a decode step of the demo model). This kernel takes the whole stacked cache and the layer index and
// reads each (row, key/value head)'s cached keys where they lie, and only those the cached mask lets it read.
//
// Layout: q, out [B, T, Hkv, G, D] (query head hk * G + g reads key/value head hk); keys, values [L, B, Hkv, S, D];
// layer [] int32; cached_mask [B, Tm, W] int32 with Tm 1 (every query reads the same positions) or T, W <= S;
// new_k, new_v [B, T, Hkv, D] (this call's keys, not yet in the cache); new_mask [B, T, T] int32. Each query's
// scores over the readable cached positions and new keys are scaled, softmaxed together and weight the values. A
// query that may read nothing gets 0 (the XLA form averages the values uniformly; such a row is never read).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeadDim = 256;

struct Shape {
  int64_t layers, batch, length, kv_heads, groups, head_dim, slot_len, window, mask_rows;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void AddScaled(float weight, const float* row, int64_t n, float* acc) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += weight * row[d];
}

// Every query of batch row b and key/value head hk: its scores over the readable keys, their exponentials in one
// vectorised pass, then the weighted values; each key and value row is read once per query head of the group.
void AttendPair(const Shape& s, const float* q, const float* cache_k, const float* cache_v, int64_t layer,
                const int32_t* cached_mask, const float* new_k, const float* new_v, const int32_t* new_mask,
                float scale, int64_t b, int64_t hk, float* out) {
  const int64_t dim = s.head_dim;
  const int64_t row = ((layer * s.batch + b) * s.kv_heads + hk) * s.slot_len * dim;  // position 0 of this pair
  const float *keys = cache_k + row, *values = cache_v + row;
  // Cached positions a query may read (the same for every query when Tm is 1) and its scores: per thread, kept
  // between calls (a decode step makes one call per layer, each over every pair).
  static thread_local std::vector<int64_t> readable;
  static thread_local std::vector<float> scores;
  float acc[kMaxHeadDim];
  for (int64_t t = 0; t < s.length; ++t) {
    if (t == 0 || s.mask_rows > 1) {
      const int32_t* mask = cached_mask + (b * s.mask_rows + (s.mask_rows > 1 ? t : 0)) * s.window;
      readable.clear();
      for (int64_t p = 0; p < s.window; ++p) {
        if (mask[p]) readable.push_back(p);
      }
    }
    const int32_t* own = new_mask + (b * s.length + t) * s.length;
    for (int64_t g = 0; g < s.groups; ++g) {
      const int64_t index = ((b * s.length + t) * s.kv_heads + hk) * s.groups * dim + g * dim;
      const float* query = q + index;
      scores.clear();
      for (int64_t p : readable) scores.push_back(scale * Dot(query, keys + p * dim, dim));
      for (int64_t u = 0; u < s.length; ++u) {
        if (own[u]) scores.push_back(scale * Dot(query, new_k + ((b * s.length + u) * s.kv_heads + hk) * dim, dim));
      }
      const int64_t count = static_cast<int64_t>(scores.size());
      float* weights = scores.data();
      float top = -INFINITY, total = 0.0f;
      for (int64_t i = 0; i < count; ++i) top = std::max(top, weights[i]);
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < count; ++i) {  // one vectorised pass of exponentials
        weights[i] = std::exp(weights[i] - top);
        total += weights[i];
      }
      std::fill(acc, acc + dim, 0.0f);
      int64_t i = 0;
      for (int64_t p : readable) AddScaled(weights[i++], values + p * dim, dim, acc);
      for (int64_t u = 0; u < s.length; ++u) {
        if (own[u]) AddScaled(weights[i++], new_v + ((b * s.length + u) * s.kv_heads + hk) * dim, dim, acc);
      }
      const float inverse = count > 0 ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; ++d) out[index + d] = acc[d] * inverse;
    }
  }
}

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& keys,
                       const ffi::Buffer<ffi::F32>& values, const ffi::Buffer<ffi::S32>& cached_mask,
                       const ffi::Buffer<ffi::F32>& new_k, const ffi::Buffer<ffi::F32>& new_v,
                       const ffi::Buffer<ffi::S32>& new_mask, Shape* shape) {
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), cd = cached_mask.dimensions();
  auto nkd = new_k.dimensions(), nvd = new_v.dimensions(), nd = new_mask.dimensions();
  if (qd.size() != 5 || kd.size() != 5 || vd.size() != 5 || cd.size() != 3 || nkd.size() != 4 || nvd.size() != 4 ||
      nd.size() != 3) {
    return ffi::Error::InvalidArgument("cpu cached attention: q [B, T, Hkv, G, D], keys and values [L, B, Hkv, S, "
                                       "D], cached_mask [B, 1 or T, W], new_k and new_v [B, T, Hkv, D], new_mask "
                                       "[B, T, T]");
  }
  *shape = Shape{kd[0], qd[0], qd[1], qd[2], qd[3], qd[4], kd[3], cd[2], cd[1]};
  const Shape& s = *shape;
  bool ok = kd[1] == s.batch && kd[2] == s.kv_heads && kd[4] == s.head_dim && s.head_dim <= kMaxHeadDim;
  for (int64_t i = 0; i < 5; ++i) ok = ok && vd[i] == kd[i];
  ok = ok && cd[0] == s.batch && (s.mask_rows == 1 || s.mask_rows == s.length) && s.window <= s.slot_len;
  ok = ok && nkd[0] == s.batch && nkd[1] == s.length && nkd[2] == s.kv_heads && nkd[3] == s.head_dim;
  for (int64_t i = 0; i < 4; ++i) ok = ok && nvd[i] == nkd[i];
  ok = ok && nd[0] == s.batch && nd[1] == s.length && nd[2] == s.length;
  if (!ok) {
    return ffi::Error::InvalidArgument("cpu cached attention: shapes disagree (q [B, T, Hkv, G, D], keys and values "
                                       "[L, B, Hkv, S, D], cached_mask [B, 1 or T, W <= S], new_k and new_v "
                                       "[B, T, Hkv, D], new_mask [B, T, T], D <= 256)");
  }
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                  ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cached_mask,
                  ffi::Buffer<ffi::F32> new_k, ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::S32> new_mask, float scale,
                  ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (ffi::Error error = CheckShapes(q, keys, values, cached_mask, new_k, new_v, new_mask, &s); error.failure()) {
    return error;
  }
  const int64_t l = layer.typed_data()[0];
  if (layer.element_count() != 1 || l < 0 || l >= s.layers) {
    return ffi::Error::InvalidArgument("cpu cached attention: layer must be one index in [0, L)");
  }
  const float *qp = q.typed_data(), *kp = keys.typed_data(), *vp = values.typed_data();
  const float *nkp = new_k.typed_data(), *nvp = new_v.typed_data();
  const int32_t *cm = cached_mask.typed_data(), *nm = new_mask.typed_data();
  float* op = out->typed_data();
  // The (row, head) pairs go to XLA's own intra-op threads, the calling one included: they are idle while this
  // call runs. (OpenMP's workers would spin between calls, taking a core from the XLA ops around them.) The caller
  // waits for the pairs to be done, never for a queued task to start: when every pool thread is itself waiting in a
  // call like this one (two engines in one process), the queued tasks run later, find no pair left and only touch
  // the shared counters, which they keep alive.
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  const auto progress = std::make_shared<Progress>();
  const int64_t pairs = s.batch * s.kv_heads;
  auto work = [=] {
    for (int64_t pair; (pair = progress->next.fetch_add(1)) < pairs;) {
      AttendPair(s, qp, kp, vp, l, cm, nkp, nvp, nm, scale, pair / s.kv_heads, pair % s.kv_heads, op);
      progress->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::clamp<int64_t>(pool.num_threads(), 1, pairs) - 1;
  for (int64_t helper = 0; helper < helpers; ++helper) pool.Schedule([work] { work(); });
  work();
  while (progress->done.load() < pairs) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RstarCpuCachedAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
