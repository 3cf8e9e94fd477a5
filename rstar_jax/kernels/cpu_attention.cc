// Fused causal attention for XLA:CPU (issue 12): FlashAttention-2's forward and backward passes as two XLA FFI
// handlers, float32, over packed rows with segment ids (the rule of rstar_jax/model/segments.py:allowed_keys).
//
// Layout: q, out, d_out [B, T, H, D]; k, v [B, T, Hk, D] with query head h reading key/value head h / (H / Hk);
// segments [B, T] int32; lse [B, H, T] (the log-sum-exp of each query's scaled scores). Work is split over
// (batch row, key/value head) pairs with OpenMP: each pair owns its slice of every output, so the backward pass
// accumulates the key and value gradients of the G query heads that share a key head without atomics.
//
// Per pair, the keys and values are packed once (zero-padded to whole blocks of kBlock tokens and head dims to a
// multiple of kDimTile; keys also transposed per block, [D, kBlock]) for all its query heads. Queries go in blocks
// of kBlock against key blocks up to the diagonal; every product of two blocks is a register-blocked
// micro-kernel (16 vector accumulators, each loaded vector feeding several FMAs). Only tiles on the diagonal or
// across segment boundaries are masked; tiles no query of the block may read are skipped. A query that reads no
// key (padding before a row's first real token) gets output 0 and lse 0, and no gradient: its output is never read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Floats per vector, and vector accumulators per micro-kernel: half the registers, the rest hold loaded operands.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16, kAccumulators = 16;
#else
constexpr int64_t kLanes = 8, kAccumulators = 8;  // AVX2; GCC splits the vectors on narrower machines
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr int64_t kBlock = 64;     // queries per query block and keys per key block (aligned, so one diagonal tile)
constexpr int64_t kDimTile = 32;   // head dims per accumulator tile; packed head dims are padded to a multiple
constexpr int64_t kRowTile = 8;    // query rows are computed in multiples of this (padding rows are zero)
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kKeyVectors = kBlock / kLanes, kDimVectors = kDimTile / kLanes;
constexpr int64_t kScoreRows = kAccumulators / kKeyVectors;  // rows x a block of keys
constexpr int64_t kSumRows = kAccumulators / kDimVectors;    // rows x a tile of head dims
static_assert(kRowTile % kScoreRows == 0 && kRowTile % kSumRows == 0 && kBlock % kRowTile == 0);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t batch, length, heads, kv_heads, head_dim;
  int64_t groups() const { return heads / kv_heads; }
  int64_t blocks() const { return (length + kBlock - 1) / kBlock; }
  int64_t padded_dim() const { return (head_dim + kDimTile - 1) / kDimTile * kDimTile; }
  int64_t q_index(int64_t b, int64_t t, int64_t h) const { return ((b * length + t) * heads + h) * head_dim; }
  int64_t kv_index(int64_t b, int64_t t, int64_t hk) const {
    return ((b * length + t) * kv_heads + hk) * head_dim;
  }
  int64_t lse_index(int64_t b, int64_t h, int64_t t) const { return (b * heads + h) * length + t; }
};

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// Pins a loaded vector to a register. Without it GCC folds the load into every FMA that uses the vector (one
// memory operand per FMA), which makes the micro-kernels bound by loads instead of FMAs.
inline void KeepInRegister(Vec& v) {
#if defined(__AVX__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// e^x for x <= 0 (scores minus their row maximum): 2^n times a degree-6 polynomial of the remainder
// r = x - n ln 2 in [-ln2/2, ln2/2] (relative error ~2e-7); -inf and anything below -87 give 0.
inline Vec ExpNonPositive(Vec x) {
  const Vec clamped = x < -87.0f ? Vec{} - 87.0f : x;
  // Truncating y - 1/2 rounds y <= 0 to the nearest integer (ties aside).
  const IntVec n_int = __builtin_convertvector(clamped * 1.44269504088896341f - 0.5f, IntVec);
  const Vec n = __builtin_convertvector(n_int, Vec);
  const Vec r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Vec poly = Vec{} + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const Vec power = __builtin_bit_cast(Vec, (n_int + 127) << 23);
  return x < -87.0f ? Vec{} : poly * power;
}

inline float ExpNonPositive(float x) { return ExpNonPositive(Vec{} + x)[0]; }

inline float HorizontalMax(Vec v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

inline float HorizontalSum(Vec v) {
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// Rows [0, kScoreRows) of a[., dim] . columns[dim, kBlock] against the block's first kVectors vectors of keys,
// into out (row stride kBlock); the later keys' entries are set to 0. Each loaded key vector feeds kScoreRows FMAs.
template <int64_t kVectors>
void ScoreTile(const float* __restrict a, const float* __restrict columns, int64_t dim, float* __restrict out) {
  Vec acc[kScoreRows][kVectors] = {};
  for (int64_t d = 0; d < dim; ++d) {
    Vec column[kVectors];
    for (int64_t c = 0; c < kVectors; ++c) {
      column[c] = Load(columns + d * kBlock + c * kLanes);
      KeepInRegister(column[c]);
    }
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const float x = a[r * dim + d];
      for (int64_t c = 0; c < kVectors; ++c) acc[r][c] += x * column[c];
    }
  }
  for (int64_t r = 0; r < kScoreRows; ++r) {
    for (int64_t c = 0; c < kKeyVectors; ++c) Store(out + r * kBlock + c * kLanes, c < kVectors ? acc[r][c] : Vec{});
  }
}

// ScoreTile<vectors> for a run-time count of key vectors in [1, kKeyVectors].
template <int64_t kVectors = kKeyVectors>
void ScoreTileUpTo(int64_t vectors, const float* a, const float* columns, int64_t dim, float* out) {
  if constexpr (kVectors > 1) {
    if (vectors < kVectors) return ScoreTileUpTo<kVectors - 1>(vectors, a, columns, dim, out);
  }
  ScoreTile<kVectors>(a, columns, dim, out);
}

// out[rows, kBlock] = a[rows, dim] . columns[dim, kBlock]: scores (queries . keys) or dP (output gradients .
// values). On the diagonal tile (query i and key i at the same position) keys after a row tile's last query are
// not computed (set to 0: they are masked).
void RowsTimesColumns(const float* a, const float* columns, int64_t rows, int64_t dim, bool diagonal, float* out) {
  for (int64_t i0 = 0; i0 < rows; i0 += kScoreRows) {
    const int64_t vectors = diagonal ? (i0 + kScoreRows - 1) / kLanes + 1 : kKeyVectors;
    ScoreTileUpTo(vectors, a + i0 * dim, columns, dim, out + i0 * kBlock);
  }
}

// out[rows, dim] += weights[rows, n] . b[n, dim], weights with row stride kBlock: P . V and dS . K. kSumRows rows
// at once, so each loaded row of b feeds kSumRows FMAs per vector. On the diagonal tile a row tile stops at the
// key of its last query (later weights are 0).
void AddWeightedRows(const float* __restrict weights, const float* __restrict b, int64_t rows, int64_t n,
                     int64_t dim, bool diagonal, float* __restrict out) {
  for (int64_t i0 = 0; i0 < rows; i0 += kSumRows) {
    const int64_t keys = diagonal ? std::min(n, i0 + kSumRows) : n;
    for (int64_t d0 = 0; d0 < dim; d0 += kDimTile) {
      Vec acc[kSumRows][kDimVectors];
      for (int64_t r = 0; r < kSumRows; ++r) {
        for (int64_t c = 0; c < kDimVectors; ++c) acc[r][c] = Load(out + (i0 + r) * dim + d0 + c * kLanes);
      }
      for (int64_t j = 0; j < keys; ++j) {
        Vec row[kDimVectors];
        for (int64_t c = 0; c < kDimVectors; ++c) {
          row[c] = Load(b + j * dim + d0 + c * kLanes);
          KeepInRegister(row[c]);
        }
        for (int64_t r = 0; r < kSumRows; ++r) {
          const float w = weights[(i0 + r) * kBlock + j];
          for (int64_t c = 0; c < kDimVectors; ++c) acc[r][c] += w * row[c];
        }
      }
      for (int64_t r = 0; r < kSumRows; ++r) {
        for (int64_t c = 0; c < kDimVectors; ++c) Store(out + (i0 + r) * dim + d0 + c * kLanes, acc[r][c]);
      }
    }
  }
}

// out[n, dim] += weights[rows, n]^T . a[rows, dim] (out[j] += sum_i weights[i, j] a[i]), weights with row stride
// kBlock, n a multiple of kSumRows: P^T . dO and dS^T . Q. kSumRows keys at once per loaded row of a. On the
// diagonal tile a key tile starts at the query of its first key (earlier weights are 0).
void AddTransposedWeightedRows(const float* __restrict weights, const float* __restrict a, int64_t rows,
                               int64_t n, int64_t dim, bool diagonal, float* __restrict out) {
  for (int64_t j0 = 0; j0 < n; j0 += kSumRows) {
    for (int64_t d0 = 0; d0 < dim; d0 += kDimTile) {
      Vec acc[kSumRows][kDimVectors];
      for (int64_t r = 0; r < kSumRows; ++r) {
        for (int64_t c = 0; c < kDimVectors; ++c) acc[r][c] = Load(out + (j0 + r) * dim + d0 + c * kLanes);
      }
      for (int64_t i = diagonal ? j0 : 0; i < rows; ++i) {
        Vec row[kDimVectors];
        for (int64_t c = 0; c < kDimVectors; ++c) {
          row[c] = Load(a + i * dim + d0 + c * kLanes);
          KeepInRegister(row[c]);
        }
        for (int64_t r = 0; r < kSumRows; ++r) {
          const float w = weights[i * kBlock + j0 + r];
          for (int64_t c = 0; c < kDimVectors; ++c) acc[r][c] += w * row[c];
        }
      }
      for (int64_t r = 0; r < kSumRows; ++r) {
        for (int64_t c = 0; c < kDimVectors; ++c) Store(out + (j0 + r) * dim + d0 + c * kLanes, acc[r][c]);
      }
    }
  }
}

constexpr int64_t kPrefetchDistance = 8;  // rows

// Starts loading row t + kPrefetchDistance (of `rows` rows `stride` floats apart from `first`) into the cache: a
// head's rows lie H * D floats apart and a pair copies one row at a time, so without it every row costs a miss.
inline void PrefetchAhead(const float* first, int64_t stride, int64_t t, int64_t rows, int64_t dim) {
  if (t + kPrefetchDistance >= rows) return;
  const float* row = first + (t + kPrefetchDistance) * stride;
  for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) __builtin_prefetch(row + d);
}

// Head hk of `src` ([B, T, Hk, D]: keys or values) of batch row b as `rows` [blocks * kBlock, padded D] and/or
// transposed per block as `columns` [blocks][padded D][kBlock], zero-padded; either may be null.
void PackPair(const Shape& s, const float* src, int64_t b, int64_t hk, std::vector<float>* rows,
              std::vector<float>* columns) {
  const int64_t dim = s.head_dim, padded = s.padded_dim(), size = s.blocks() * kBlock * padded;
  if (rows != nullptr) rows->assign(size, 0.0f);
  if (columns != nullptr) columns->assign(size, 0.0f);
  for (int64_t t = 0; t < s.length; ++t) {
    const float* row = src + s.kv_index(b, t, hk);
    PrefetchAhead(src + s.kv_index(b, 0, hk), s.kv_heads * dim, t, s.length, dim);
    if (rows != nullptr) std::copy_n(row, dim, rows->data() + t * padded);
    if (columns != nullptr) {
      float* block = columns->data() + t / kBlock * padded * kBlock + t % kBlock;
      for (int64_t d = 0; d < dim; ++d) block[d * kBlock] = row[d];
    }
  }
}

// Rows [t0, t0 + n) of head h of `src` ([B, T, H, D]: queries or output gradients) as dst [kBlock, padded D],
// zero-padded.
void PackQueryBlock(const Shape& s, const float* src, int64_t b, int64_t h, int64_t t0, int64_t n,
                    std::vector<float>* dst) {
  const int64_t padded = s.padded_dim();
  dst->assign(kBlock * padded, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    PrefetchAhead(src + s.q_index(b, t0, h), s.heads * s.head_dim, i, n, s.head_dim);
    std::copy_n(src + s.q_index(b, t0 + i, h), s.head_dim, dst->data() + i * padded);
  }
}

// The segment ids of a block's tokens (t < T) span [min, max].
struct SegmentRange {
  int32_t min, max;
};

void BlockSegments(const Shape& s, const int32_t* segments, std::vector<SegmentRange>* ranges) {
  ranges->assign(s.blocks(), SegmentRange{std::numeric_limits<int32_t>::max(), 0});
  for (int64_t t = 0; t < s.length; ++t) {
    SegmentRange& range = (*ranges)[t / kBlock];
    range.min = std::min(range.min, segments[t]);
    range.max = std::max(range.max, segments[t]);
  }
}

enum class Tile { kSkip, kMasked, kFull };

// What a (query block, key block) tile needs: nothing if no query may read any of its keys (keys all padding, or
// queries of real segments that no key shares), no mask if it lies below the diagonal within one segment.
Tile Classify(const std::vector<SegmentRange>& ranges, int64_t query_block, int64_t key_block) {
  const SegmentRange queries = ranges[query_block], keys = ranges[key_block];
  if (keys.max == 0 || (queries.min > 0 && (keys.max < queries.min || keys.min > queries.max))) return Tile::kSkip;
  const bool one_segment = queries.min == queries.max && keys.min == keys.max && queries.min == keys.min;
  return key_block < query_block && one_segment ? Tile::kFull : Tile::kMasked;
}

// Calls visit(k0, nk, diagonal, masked) for each key block that query block qb (queries [q0, q0 + nq)) reads: the
// blocks up to the diagonal, less the skipped tiles; nk counts the block's keys up to the block's last query.
template <typename Visit>
void ForEachKeyTile(const std::vector<SegmentRange>& ranges, int64_t qb, int64_t q0, int64_t nq, Visit visit) {
  for (int64_t kb = 0; kb <= qb; ++kb) {
    const Tile tile = Classify(ranges, qb, kb);
    if (tile == Tile::kSkip) continue;
    const int64_t k0 = kb * kBlock;
    visit(k0, std::min(kBlock, q0 + nq - k0), kb == qb, tile == Tile::kMasked);
  }
}

// The scaled scores of query t against keys [k, k + kLanes), with the keys it may not read set to -inf when
// masked (allowed_keys of segments.py, and causal); `segments` is padded with 0 to whole blocks.
inline Vec ScaledScores(Vec scores, const int32_t* segments, int64_t t, int64_t k, bool masked, float scale) {
  scores *= scale;
  if (!masked) return scores;
  IntVec key_segments, positions;
  std::memcpy(&key_segments, segments + k, sizeof key_segments);
  for (int64_t l = 0; l < kLanes; ++l) positions[l] = static_cast<int32_t>(k + l);
  const int32_t query_segment = segments[t];
  const IntVec allowed = (positions <= static_cast<int32_t>(t)) & (key_segments > 0) &
                         ((key_segments == query_segment) | (query_segment == 0));
  return allowed ? scores : Vec{} + kNegInf;
}

// The online-softmax step of query t over its scores against the key block at k0 (`row`, unscaled): the row
// becomes its weights e^(s - max), the running max and sum are updated, and the factor to rescale earlier weighted
// sums by is returned.
float SoftmaxStep(float* __restrict row, const int32_t* segments, int64_t t, int64_t k0, bool masked, float scale,
                  float* row_max, float* row_sum) {
  Vec scores[kKeyVectors], block_max = Vec{} + kNegInf;
  for (int64_t c = 0; c < kKeyVectors; ++c) {
    scores[c] = ScaledScores(Load(row + c * kLanes), segments, t, k0 + c * kLanes, masked, scale);
    block_max = scores[c] > block_max ? scores[c] : block_max;
  }
  const float new_max = std::max(*row_max, HorizontalMax(block_max));
  if (new_max == kNegInf) {  // no key read yet
    std::fill_n(row, kBlock, 0.0f);
    return 1.0f;
  }
  const float rescale = ExpNonPositive(*row_max - new_max);
  Vec block_sum{};
  for (int64_t c = 0; c < kKeyVectors; ++c) {
    const Vec weights = ExpNonPositive(scores[c] - new_max);
    block_sum += weights;
    Store(row + c * kLanes, weights);
  }
  *row_sum = *row_sum * rescale + HorizontalSum(block_sum);
  *row_max = new_max;
  return rescale;
}

// Query t's probabilities P = e^(S - lse) over its scores against the key block at k0 (`p_row`, unscaled, in
// place) and the scores' gradients dS = P * (dP - term) * scale (from dP in `ds_row`, in place).
void ProbabilitiesAndGradients(float* __restrict p_row, float* __restrict ds_row, const int32_t* segments,
                               int64_t t, int64_t k0, bool masked, float scale, float lse, float term) {
  for (int64_t c = 0; c < kKeyVectors; ++c) {
    const Vec scores = ScaledScores(Load(p_row + c * kLanes), segments, t, k0 + c * kLanes, masked, scale);
    const Vec p = ExpNonPositive(scores - lse);
    Store(p_row + c * kLanes, p);
    Store(ds_row + c * kLanes, p * (Load(ds_row + c * kLanes) - term) * scale);
  }
}

// Per-thread buffers, reused across pairs and calls so that no pair allocates.
struct Workspace {
  std::vector<float> keys, keys_t, values, values_t, d_keys, d_values;  // a pair's, packed
  std::vector<float> queries, grads, acc, scores, d_scores;             // a query block's
  std::vector<int32_t> segments;                                        // the row's, padded with 0
  std::vector<SegmentRange> ranges;                                     // per block of the row
};

Workspace& ThreadWorkspace() {
  thread_local Workspace workspace;
  return workspace;
}

void PadSegments(const Shape& s, const int32_t* segments, std::vector<int32_t>* padded) {
  padded->assign(s.blocks() * kBlock, 0);
  std::copy_n(segments, s.length, padded->data());
}

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

void ForwardPair(const Shape& s, const float* q, const float* k, const float* v, const int32_t* segments_all,
                 float scale, int64_t b, int64_t hk, float* out, float* lse) {
  Workspace& w = ThreadWorkspace();
  const int64_t dim = s.head_dim, padded = s.padded_dim();
  PackPair(s, k, b, hk, nullptr, &w.keys_t);
  PackPair(s, v, b, hk, &w.values, nullptr);
  PadSegments(s, segments_all + b * s.length, &w.segments);
  BlockSegments(s, w.segments.data(), &w.ranges);
  w.scores.resize(kBlock * kBlock);
  float row_max[kBlock], row_sum[kBlock];
  for (int64_t g = 0; g < s.groups(); ++g) {
    const int64_t h = hk * s.groups() + g;
    for (int64_t qb = 0; qb < s.blocks(); ++qb) {
      const int64_t q0 = qb * kBlock, nq = std::min(kBlock, s.length - q0), rows = RoundUp(nq, kRowTile);
      PackQueryBlock(s, q, b, h, q0, nq, &w.queries);
      w.acc.assign(kBlock * padded, 0.0f);
      std::fill_n(row_max, kBlock, kNegInf);
      std::fill_n(row_sum, kBlock, 0.0f);
      ForEachKeyTile(w.ranges, qb, q0, nq, [&](int64_t k0, int64_t nk, bool diagonal, bool masked) {
        RowsTimesColumns(w.queries.data(), w.keys_t.data() + k0 * padded, rows, padded, diagonal, w.scores.data());
        for (int64_t i = 0; i < nq; ++i) {
          float* row = w.scores.data() + i * kBlock;
          const float rescale = SoftmaxStep(row, w.segments.data(), q0 + i, k0, masked, scale, &row_max[i],
                                            &row_sum[i]);
          float* acc_row = w.acc.data() + i * padded;
#pragma omp simd
          for (int64_t d = 0; d < padded; ++d) acc_row[d] *= rescale;
        }
        std::fill(w.scores.begin() + nq * kBlock, w.scores.begin() + rows * kBlock, 0.0f);  // padding rows
        AddWeightedRows(w.scores.data(), w.values.data() + k0 * padded, rows, nk, padded, diagonal, w.acc.data());
      });
      for (int64_t i = 0; i < nq; ++i) {
        float* out_row = out + s.q_index(b, q0 + i, h);
        const bool reads = row_sum[i] > 0.0f;
        const float inverse = reads ? 1.0f / row_sum[i] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) out_row[d] = w.acc[i * padded + d] * inverse;
        lse[s.lse_index(b, h, q0 + i)] = reads ? row_max[i] + std::log(row_sum[i]) : 0.0f;
      }
    }
  }
}

void BackwardPair(const Shape& s, const float* q, const float* k, const float* v, const int32_t* segments_all,
                  const float* out, const float* lse, const float* d_out, float scale, int64_t b, int64_t hk,
                  float* d_q, float* d_k, float* d_v) {
  Workspace& w = ThreadWorkspace();
  const int64_t dim = s.head_dim, padded = s.padded_dim();
  // Keys both ways ([D, keys] for the scores, [keys, D] for dQ), values as [D, keys] for dP.
  PackPair(s, k, b, hk, &w.keys, &w.keys_t);
  PackPair(s, v, b, hk, nullptr, &w.values_t);
  PadSegments(s, segments_all + b * s.length, &w.segments);
  BlockSegments(s, w.segments.data(), &w.ranges);
  w.d_keys.assign(s.blocks() * kBlock * padded, 0.0f);
  w.d_values.assign(s.blocks() * kBlock * padded, 0.0f);
  w.scores.resize(kBlock * kBlock);
  w.d_scores.resize(kBlock * kBlock);
  float row_lse[kBlock], row_term[kBlock];
  for (int64_t g = 0; g < s.groups(); ++g) {
    const int64_t h = hk * s.groups() + g;
    for (int64_t qb = 0; qb < s.blocks(); ++qb) {
      const int64_t q0 = qb * kBlock, nq = std::min(kBlock, s.length - q0), rows = RoundUp(nq, kRowTile);
      PackQueryBlock(s, q, b, h, q0, nq, &w.queries);
      PackQueryBlock(s, d_out, b, h, q0, nq, &w.grads);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t index = s.q_index(b, q0 + i, h);
        PrefetchAhead(out + s.q_index(b, q0, h), s.heads * dim, i, nq, dim);
        float term = 0.0f;
        for (int64_t d = 0; d < dim; ++d) term += w.grads[i * padded + d] * out[index + d];
        row_term[i] = term;  // D_i = dO_i . O_i, the softmax Jacobian's row term
        row_lse[i] = lse[s.lse_index(b, h, q0 + i)];
      }
      w.acc.assign(kBlock * padded, 0.0f);  // dQ of the block
      ForEachKeyTile(w.ranges, qb, q0, nq, [&](int64_t k0, int64_t nk, bool diagonal, bool masked) {
        RowsTimesColumns(w.queries.data(), w.keys_t.data() + k0 * padded, rows, padded, diagonal, w.scores.data());
        RowsTimesColumns(w.grads.data(), w.values_t.data() + k0 * padded, rows, padded, diagonal,
                         w.d_scores.data());
        for (int64_t i = 0; i < nq; ++i) {
          ProbabilitiesAndGradients(w.scores.data() + i * kBlock, w.d_scores.data() + i * kBlock, w.segments.data(),
                                    q0 + i, k0, masked, scale, row_lse[i], row_term[i]);
        }
        std::fill(w.d_scores.begin() + nq * kBlock, w.d_scores.begin() + rows * kBlock, 0.0f);  // padding rows
        const int64_t keys = RoundUp(nk, kSumRows);
        AddTransposedWeightedRows(w.scores.data(), w.grads.data(), nq, keys, padded, diagonal,
                                  w.d_values.data() + k0 * padded);
        AddTransposedWeightedRows(w.d_scores.data(), w.queries.data(), nq, keys, padded, diagonal,
                                  w.d_keys.data() + k0 * padded);
        AddWeightedRows(w.d_scores.data(), w.keys.data() + k0 * padded, rows, nk, padded, diagonal, w.acc.data());
      });
      for (int64_t i = 0; i < nq; ++i) std::copy_n(w.acc.data() + i * padded, dim, d_q + s.q_index(b, q0 + i, h));
    }
  }
  for (int64_t t = 0; t < s.length; ++t) {
    std::copy_n(w.d_keys.data() + t * padded, dim, d_k + s.kv_index(b, t, hk));
    std::copy_n(w.d_values.data() + t * padded, dim, d_v + s.kv_index(b, t, hk));
  }
}

// Calls `call(b, hk)` for every (batch row, key/value head) pair, in parallel.
template <typename Call>
void ForEachPair(const Shape& s, Call call) {
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t hk = 0; hk < s.kv_heads; ++hk) call(b, hk);
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
  ForEachPair(s, [&](int64_t b, int64_t hk) { ForwardPair(s, qp, kp, vp, sp, scale, b, hk, op, lp); });
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
  ForEachPair(s, [&](int64_t b, int64_t hk) {
    BackwardPair(s, qp, kp, vp, sp, op, lp, gp, scale, b, hk, dq, dk, dv);
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
