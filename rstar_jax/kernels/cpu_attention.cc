// Fused causal attention for XLA:CPU (issue 12): FlashAttention-2's forward and backward passes as two XLA FFI
// handlers, float32, over packed rows with segment ids (the rule of rstar_jax/model/segments.py:allowed_keys).
//
// Layout: q, out, d_out [B, T, H, D]; k, v [B, T, Hk, D] with query head h reading key/value head h / (H / Hk);
// segments [B, T] int32; lse [B, H, T] (the log-sum-exp of each query's scaled scores). Work is split over
// (batch row, key/value head) pairs with OpenMP: each pair owns its slice of every output, so the backward pass
// accumulates the key and value gradients of the G query heads that share a key head without atomics.
//
// Per pair, queries go in blocks of kQueryBlock and keys in blocks of kKeyBlock up to the causal limit; a key
// block is copied transposed ([D, keys]) so the score and gradient loops run over contiguous keys (vectorised
// by the compiler). Keys above the diagonal are never visited. A query that reads no key (padding before a row's
// first real token) gets output 0 and lse 0, and no gradient: its output is never read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t batch, length, heads, kv_heads, head_dim;
  int64_t groups() const { return heads / kv_heads; }
  int64_t q_index(int64_t b, int64_t t, int64_t h) const { return ((b * length + t) * heads + h) * head_dim; }
  int64_t kv_index(int64_t b, int64_t t, int64_t hk) const {
    return ((b * length + t) * kv_heads + hk) * head_dim;
  }
  int64_t lse_index(int64_t b, int64_t h, int64_t t) const { return (b * heads + h) * length + t; }
};

// e^x for x <= 0 (scores minus their row maximum), vectorisable: 2^n times a degree-6 polynomial of the
// remainder r = x - n ln 2 in [-ln2/2, ln2/2] (relative error ~2e-7); -inf and anything below -87 give 0.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return x < -87.0f ? 0.0f : poly * __builtin_bit_cast(float, bits);
}

// Rows [k0, k0 + nk) of head hk of `src` ([B, T, Hk, D]: keys or values) as `rows` [kKeyBlock, D] and/or
// transposed as `columns` [D, kKeyBlock]; either may be null.
void LoadBlock(const Shape& s, const float* src, int64_t b, int64_t hk, int64_t k0, int64_t nk,
               float* __restrict rows, float* __restrict columns) {
  const int64_t dim = s.head_dim;
  for (int64_t j = 0; j < nk; ++j) {
    const float* row = src + s.kv_index(b, k0 + j, hk);
    if (rows != nullptr) std::copy_n(row, dim, rows + j * dim);
    if (columns != nullptr) {
      for (int64_t d = 0; d < dim; ++d) columns[d * kKeyBlock + j] = row[d];
    }
  }
}

// Scaled scores [nq, kKeyBlock] of queries (rows of `queries`, [nq, D]) against the transposed key block, with
// masked entries (above the diagonal, or across segments) set to -inf.
void Scores(const Shape& s, const float* __restrict queries, const float* __restrict keys_t,
            const int32_t* segments, int64_t q0, int64_t nq, int64_t k0, int64_t nk, float scale,
            float* __restrict scores) {
  int32_t key_segments[kKeyBlock], key_positions[kKeyBlock];
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    key_segments[j] = j < nk ? segments[k0 + j] : 0;  // keys past the block's end read as padding: masked
    key_positions[j] = static_cast<int32_t>(k0 + j);
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* row = scores + i * kKeyBlock;
    float acc[kKeyBlock] = {};  // a register-resident row: 4 AVX-512 vectors
    const float* query = queries + i * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; ++d) {
      const float qd = query[d];
      const float* key_row = keys_t + d * kKeyBlock;
#pragma omp simd
      for (int64_t j = 0; j < kKeyBlock; ++j) acc[j] += qd * key_row[j];
    }
    const int32_t t = static_cast<int32_t>(q0 + i), query_segment = segments[q0 + i];
#pragma omp simd
    for (int64_t j = 0; j < kKeyBlock; ++j) {  // allowed_keys of segments.py, and causal
      const int32_t key_segment = key_segments[j];
      const bool allowed = key_positions[j] <= t && key_segment > 0 &&
                           (key_segment == query_segment || query_segment == 0);
      row[j] = allowed ? acc[j] * scale : kNegInf;
    }
  }
}

// kDim: the head dimension when known at compile time (the common 32, 64, 128), else 0 for any up to kMaxHeadDim.
template <int64_t kDim>
void ForwardPair(const Shape& s, const float* q, const float* k, const float* v, const int32_t* seg_all,
                 float scale, int64_t b, int64_t hk, float* out, float* lse) {
  constexpr int64_t kCapacity = kDim ? kDim : kMaxHeadDim;
  const int64_t dim = kDim ? kDim : s.head_dim;
  const int32_t* segments = seg_all + b * s.length;
  std::vector<float> keys_t(dim * kKeyBlock, 0.0f), values(kKeyBlock * dim, 0.0f), queries(kQueryBlock * dim);
  std::vector<float> scores(kQueryBlock * kKeyBlock), acc(kQueryBlock * dim);
  float row_max[kQueryBlock], row_sum[kQueryBlock];
  for (int64_t g = 0; g < s.groups(); ++g) {
    const int64_t h = hk * s.groups() + g;
    for (int64_t q0 = 0; q0 < s.length; q0 += kQueryBlock) {
      const int64_t nq = std::min(kQueryBlock, s.length - q0);
      for (int64_t i = 0; i < nq; ++i) {
        std::copy_n(q + s.q_index(b, q0 + i, h), dim, queries.data() + i * dim);
        row_max[i] = kNegInf;
        row_sum[i] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t key_end = q0 + nq;
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, key_end - k0);
        LoadBlock(s, k, b, hk, k0, nk, nullptr, keys_t.data());
        LoadBlock(s, v, b, hk, k0, nk, values.data(), nullptr);
        Scores(s, queries.data(), keys_t.data(), segments, q0, nq, k0, nk, scale, scores.data());
        for (int64_t i = 0; i < nq; ++i) {
          float* row = scores.data() + i * kKeyBlock;
          float block_max = kNegInf;
          for (int64_t j = 0; j < nk; ++j) block_max = std::max(block_max, row[j]);
          const float new_max = std::max(row_max[i], block_max);
          if (new_max == kNegInf) continue;  // no key read yet
          const float rescale = ExpNonPositive(row_max[i] - new_max);
          float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t j = 0; j < nk; ++j) {
            row[j] = ExpNonPositive(row[j] - new_max);
            block_sum += row[j];
          }
          row_sum[i] = row_sum[i] * rescale + block_sum;
          row_max[i] = new_max;
          float* acc_row = acc.data() + i * dim;
          float weighted[kCapacity];  // the row's output accumulator, in registers for this key block
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) weighted[d] = acc_row[d] * rescale;
          for (int64_t j = 0; j < nk; ++j) {
            const float p = row[j];
            const float* __restrict value = values.data() + j * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) weighted[d] += p * value[d];
          }
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) acc_row[d] = weighted[d];
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* out_row = out + s.q_index(b, q0 + i, h);
        const bool reads = row_sum[i] > 0.0f;
        const float inverse = reads ? 1.0f / row_sum[i] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) out_row[d] = acc[i * dim + d] * inverse;
        lse[s.lse_index(b, h, q0 + i)] = reads ? row_max[i] + std::log(row_sum[i]) : 0.0f;
      }
    }
  }
}

template <int64_t kDim>
void BackwardPair(const Shape& s, const float* q, const float* k, const float* v, const int32_t* seg_all,
                  const float* out, const float* lse, const float* d_out, float scale, int64_t b, int64_t hk,
                  float* d_q, float* d_k, float* d_v) {
  constexpr int64_t kCapacity = kDim ? kDim : kMaxHeadDim;
  const int64_t dim = kDim ? kDim : s.head_dim;
  const int32_t* segments = seg_all + b * s.length;
  std::vector<float> keys_t(dim * kKeyBlock, 0.0f), values_t(dim * kKeyBlock, 0.0f), keys(kKeyBlock * dim);
  std::vector<float> queries(kQueryBlock * dim), grads(kQueryBlock * dim);
  std::vector<float> probs(kQueryBlock * kKeyBlock), d_scores(kQueryBlock * kKeyBlock), d_q_acc(kQueryBlock * dim);
  float row_lse[kQueryBlock], row_term[kQueryBlock];
  bool row_reads[kQueryBlock];
  for (int64_t t = 0; t < s.length; ++t) {
    std::fill_n(d_k + s.kv_index(b, t, hk), dim, 0.0f);
    std::fill_n(d_v + s.kv_index(b, t, hk), dim, 0.0f);
  }
  for (int64_t g = 0; g < s.groups(); ++g) {
    const int64_t h = hk * s.groups() + g;
    for (int64_t q0 = 0; q0 < s.length; q0 += kQueryBlock) {
      const int64_t nq = std::min(kQueryBlock, s.length - q0);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t index = s.q_index(b, q0 + i, h);
        std::copy_n(q + index, dim, queries.data() + i * dim);
        std::copy_n(d_out + index, dim, grads.data() + i * dim);
        float term = 0.0f;
        for (int64_t d = 0; d < dim; ++d) term += d_out[index + d] * out[index + d];
        row_term[i] = term;  // D_i = dO_i . O_i, the softmax Jacobian's row term
        row_lse[i] = lse[s.lse_index(b, h, q0 + i)];
      }
      std::fill(d_q_acc.begin(), d_q_acc.end(), 0.0f);
      const int64_t key_end = q0 + nq;
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, key_end - k0);
        // Keys both ways ([D, keys] for the scores, [keys, D] for dQ), values as [D, keys] for dP.
        LoadBlock(s, k, b, hk, k0, nk, keys.data(), keys_t.data());
        LoadBlock(s, v, b, hk, k0, nk, nullptr, values_t.data());
        Scores(s, queries.data(), keys_t.data(), segments, q0, nq, k0, nk, scale, probs.data());
        for (int64_t i = 0; i < nq; ++i) {
          float* p_row = probs.data() + i * kKeyBlock;
          float* ds_row = d_scores.data() + i * kKeyBlock;
          float total = 0.0f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < kKeyBlock; ++j) {
            p_row[j] = ExpNonPositive(p_row[j] - row_lse[i]);
            total += p_row[j];
          }
          row_reads[i] = total > 0.0f;
          // dP_ij = dO_i . V_j over the transposed values, then dS = P * (dP - D_i) * scale.
          float d_probs[kKeyBlock] = {};
          const float* __restrict grad = grads.data() + i * dim;
          const float* __restrict values_block = values_t.data();
          for (int64_t d = 0; d < dim; ++d) {
            const float gd = grad[d];
            const float* value_row = values_block + d * kKeyBlock;
#pragma omp simd
            for (int64_t j = 0; j < kKeyBlock; ++j) d_probs[j] += gd * value_row[j];
          }
#pragma omp simd
          for (int64_t j = 0; j < kKeyBlock; ++j) ds_row[j] = p_row[j] * (d_probs[j] - row_term[i]) * scale;
        }
        // Key and value gradients: per key, sums over the block's queries kept in registers, added once.
        for (int64_t j = 0; j < nk; ++j) {
          float dk_sum[kCapacity] = {}, dv_sum[kCapacity] = {};
          for (int64_t i = 0; i < nq; ++i) {
            const float p = probs[i * kKeyBlock + j], ds = d_scores[i * kKeyBlock + j];
            const float* __restrict grad = grads.data() + i * dim;
            const float* __restrict query = queries.data() + i * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) {
              dv_sum[d] += p * grad[d];
              dk_sum[d] += ds * query[d];
            }
          }
          float* __restrict dv_row = d_v + s.kv_index(b, k0 + j, hk);
          float* __restrict dk_row = d_k + s.kv_index(b, k0 + j, hk);
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) {
            dv_row[d] += dv_sum[d];
            dk_row[d] += dk_sum[d];
          }
        }
        // Query gradients: dQ_i += sum_j dS_ij K_j.
        for (int64_t i = 0; i < nq; ++i) {
          if (!row_reads[i]) continue;
          float dq_sum[kCapacity] = {};
          const float* ds_row = d_scores.data() + i * kKeyBlock;
          for (int64_t j = 0; j < nk; ++j) {
            const float ds = ds_row[j];
            const float* __restrict key = keys.data() + j * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) dq_sum[d] += ds * key[d];
          }
          float* __restrict dq_row = d_q_acc.data() + i * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) dq_row[d] += dq_sum[d];
        }
      }
      for (int64_t i = 0; i < nq; ++i) std::copy_n(d_q_acc.data() + i * dim, dim, d_q + s.q_index(b, q0 + i, h));
    }
  }
}

// Calls `call(dim, b, hk)` for every (batch row, key/value head) pair, in parallel; `dim` is a
// std::integral_constant holding the head dimension when the kernel specialises it (32, 64, 128), else 0.
template <typename Call>
void ForEachPair(const Shape& s, Call call) {
  auto run = [&](auto dim) {
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t hk = 0; hk < s.kv_heads; ++hk) call(dim, b, hk);
    }
  };
  switch (s.head_dim) {
    case 32: return run(std::integral_constant<int64_t, 32>{});
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
                       const ffi::Buffer<ffi::F32>& v, const ffi::Buffer<ffi::S32>& segments, Shape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = segments.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("cpu attention needs q, k, v of rank 4 and segments of rank 2");
  }
  *shape = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  if (kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || sd[0] != qd[0] || sd[1] != qd[1] || shape->kv_heads <= 0 ||
      shape->heads % shape->kv_heads != 0 || shape->head_dim > kMaxHeadDim) {
    return ffi::Error::InvalidArgument("cpu attention: q [B, T, H, D], k and v [B, T, Hk, D] with Hk dividing H, "
                                       "D <= 256, segments [B, T]");
  }
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> segments, float scale, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  Shape s;
  if (ffi::Error error = CheckShapes(q, k, v, segments, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* sp = segments.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  ForEachPair(s, [&](auto dim, int64_t b, int64_t hk) {
    ForwardPair<decltype(dim)::value>(s, qp, kp, vp, sp, scale, b, hk, op, lp);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> d_out, float scale, ffi::ResultBuffer<ffi::F32> d_q,
                    ffi::ResultBuffer<ffi::F32> d_k, ffi::ResultBuffer<ffi::F32> d_v) {
  Shape s;
  if (ffi::Error error = CheckShapes(q, k, v, segments, &s); error.failure()) return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = out.typed_data();
  const float *lp = lse.typed_data(), *gp = d_out.typed_data();
  const int32_t* sp = segments.typed_data();
  float *dq = d_q->typed_data(), *dk = d_k->typed_data(), *dv = d_v->typed_data();
  ForEachPair(s, [&](auto dim, int64_t b, int64_t hk) {
    BackwardPair<decltype(dim)::value>(s, qp, kp, vp, sp, op, lp, gp, scale, b, hk, dq, dk, dv);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RstarCpuAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RstarCpuAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
