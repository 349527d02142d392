// Paged attention of the XLA ragged backend's query groups on the CPU: XLA FFI custom calls.
//
// cbjax.kernels.native builds this file with the system C++ compiler at first use and
// registers it as the custom call targets "cbjax_single_groups", "cbjax_block_groups_into"
// (below: the block list, the same inputs with q_idx s32[capacity, block], written in token
// order into the single list's output) and "cbjax_write_kv" (below: a layer's new K/V rows into
// the cache, in place, from the fused q/k/v product). The first runs the single list of
// the XLA ragged backend (cbjax.kernels.xla_ragged): each group is one query token, which
// attends over its row's keys 0 .. its position, read in place from the paged cache (no
// gather copies), with an online softmax per page. Keys past the position are never read,
// so unwritten slots (NaN in tests) and other rows' pages never reach the result.
//
// Inputs (row-major):
//   q          f32[tokens, kv_heads, G, head_dim]          queries, unscaled: the layer's [tokens,
//                                                          heads, head_dim] projection as is (G =
//                                                          group), or the fused q/k/v product read
//                                                          in place (G = group + 2: each kv head's
//                                                          queries, then its k and v rows)
//   pos        s32[tokens + 1]                              each token's position; -1 for padding
//   q_idx      s32[capacity]                                the group's token; `tokens` for padding
//   row        s32[capacity]                                the group's page-table row
//   page_table s32[rows, max_pages]
//   k, v       f32[num_flat_pages, page_size * head_dim]    the cache, one page per row
//   page_base  s32[kv_heads]                                flat row of page 0 for each kv head
// Attributes: num_pages (pages per kv head of one layer; page ids are clipped to it); scale
//   (each query is multiplied by it, in f32, before its scores).
// Output (its shape gives `group`):
//   out        f32[tokens, kv_heads, group, head_dim]      each group's result at its token's row
//              (the layer's [tokens, heads, head_dim] attention output as is), zeros for tokens
//              in no group; the block list then writes its tokens' rows into it in place, so a
//              mixed step's attention leaves in token order, its queries came in token order,
//              and no transpose, scatter or scaling pass runs around the kernels.
//
// The (kv head, group) pairs are split over threads: RunChunks's helper team (native_common.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "native_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Args {
  const float* q;
  const int32_t* pos;
  const int32_t* q_idx;
  const int32_t* row;
  const int32_t* page_table;
  const float* k;
  const float* v;
  const int32_t* page_base;
  float* out;
  int64_t kv_heads, tokens1, group, head_dim, capacity, max_pages, page_size, num_pages;
  float scale;
  int64_t q_group;  // q's third axis: the group's query heads first (more may follow, as in the q/k/v product)
};

using cbjax_native::ExpNonPositiveVec;
using cbjax_native::ExpOfRemainder;

// ExpNonPositiveVec (native_common.h) on one float.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float p = ExpOfRemainder(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

using cbjax_native::IVec;
using cbjax_native::kLanes;
using cbjax_native::Load;
using cbjax_native::Splat;
using cbjax_native::Store;
using cbjax_native::Vec;

// Pages lie anywhere in the pool, so the hardware prefetcher can't follow a row's pages: while
// page p is read, fetch the K and V of the pages up to kPagesAhead after it (all of them at p 0).
// One page ahead took 25-35% off a 32-row decode step's attention over scattered pages; two
// measured no better.
constexpr int64_t kPagesAhead = 1;

inline void PrefetchAhead(const float* k, const float* v, int64_t base, const int32_t* table, int64_t num_pages,
                          int64_t page_elems, int64_t p, int64_t pages) {
  for (int64_t q = p == 0 ? 1 : p + kPagesAhead; q <= std::min(p + kPagesAhead, pages - 1); ++q) {
    const int64_t at = (base + std::clamp<int64_t>(table[q], 0, num_pages - 1)) * page_elems;
    for (int64_t off = 0; off < page_elems; off += 16) {
      __builtin_prefetch(k + at + off);
      __builtin_prefetch(v + at + off);
    }
  }
}

// One query's online-softmax update over one page: its scores s[0, n) (overwritten by their
// weights), its running max m and sum l, and its output row o[0, D) rescaled, plus the weighted
// V rows of the page. Keys past n are never read.
inline void SoftmaxPage(float* __restrict s, int64_t n, float& m, float& l, float* __restrict o,
                        const float* __restrict vp, int64_t D) {
  float page_max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) page_max = std::max(page_max, s[j]);
  const float m_new = std::max(m, page_max);
  const float corr = m == -INFINITY ? 0.0f : ExpNonPositive(m - m_new);  // 0 before the first page
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = ExpNonPositive(s[j] - m_new);
    sum += s[j];
  }
  l = l * corr + sum;
  m = m_new;
  for (int64_t d = 0; d < D; ++d) o[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = s[j];
    const float* vj = vp + j * D;
    for (int64_t d = 0; d < D; ++d) o[d] += pj * vj[d];
  }
}

// Divides each of `rows` output rows o[r, 0:D) by its softmax sum l[r] (zeros where it is 0).
inline void Normalize(float* o, const float* l, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[r * D + d] *= inv;
  }
}

inline float HSum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// ---- a page of kLanes keys as whole vectors: scores and softmax without lane-by-lane chains ----
// The lane sums of kLanes score vectors (one per key) fold pairwise in log2(kLanes) shuffle-add
// stages into one vector of kLanes scores, where one sum per key, lane by lane, was a chain of
// kLanes dependent adds (most of a decode step's attention time); the softmax's max, exp and
// sum run on that vector (TreeSum, native_common.h). The additions run in a tree, not in lane
// order: still the same for a query alone or in any batch.

using cbjax_native::BitReverse;
using cbjax_native::kFold;
using cbjax_native::TreeSum;

// One vector's lanes reduced by max or sum in a tree (pairs kLanes / 2 apart, then closer).
template <bool kMax>
inline float TreeReduce(Vec v) {
  alignas(64) float t[kLanes];
  Store(t, v);
#pragma GCC unroll 4
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = kMax ? std::max(t[i], t[i + w]) : t[i] + t[i + w];
  return t[0];
}

// The online softmax's output update for one query over one page: o[0, D) = o * corr + the sum of
// p[j] * V row j over the page's first n keys, with the ND output vectors in registers. Keys past
// n may be unwritten (NaN): never read.
template <int ND>
inline void AddWeightedValues(float* __restrict o, float corr, const float* p, int64_t n, const float* __restrict vp) {
  constexpr int64_t D = ND * kLanes;
  Vec acc[ND];
  for (int c = 0; c < ND; ++c) acc[c] = Load(o + c * kLanes) * corr;
  for (int64_t j = 0; j < n; ++j) {
    const Vec pj = Splat(p[j]);
    for (int c = 0; c < ND; ++c) acc[c] += pj * Load(vp + j * D + c * kLanes);
  }
  for (int c = 0; c < ND; ++c) Store(o + c * kLanes, acc[c]);
}

// FixedSoftmaxPage<1, ND> on the page's scores as one vector `sv` (lane j: key j).
template <int ND>
inline void VecSoftmaxPage(Vec sv, int64_t n, float& m, float& l, float* __restrict o,
                           const float* __restrict vp) {
  const IVec valid = kFold.iota < static_cast<int32_t>(n);
  const float page_max = TreeReduce<true>(valid ? sv : Splat(-INFINITY));
  const float m_new = std::max(m, page_max);
  const float corr = m == -INFINITY ? 0.0f : ExpNonPositive(m - m_new);  // 0 before the first page
  const Vec e = ExpNonPositiveVec(valid ? sv - m_new : Splat(-87.0f));
  const Vec p = valid ? e : Vec{};
  l = l * corr + TreeReduce<false>(p);
  m = m_new;
  alignas(64) float ps[kLanes];
  Store(ps, p);
  AddWeightedValues<ND>(o, corr, ps, n, vp);
}

// SoftmaxPage for a page of NK * kLanes key slots and head_dim ND * kLanes: the softmax runs over
// every slot, those at or past n (maybe unwritten, NaN) masked out of the max and given weight 0
// (their exp takes a finite argument), and o += p v keeps the ND output vectors in registers.
// Faster than SoftmaxPage at these sizes (docs/cpu_kernels.md).
template <int NK, int ND>
inline void FixedSoftmaxPage(float* __restrict s, int64_t n, float& m, float& l, float* __restrict o,
                             const float* __restrict vp) {
  constexpr int64_t PS = NK * kLanes;
  float page_max = -INFINITY;
  for (int64_t j = 0; j < PS; ++j) page_max = std::max(page_max, j < n ? s[j] : -INFINITY);
  const float m_new = std::max(m, page_max);
  const float corr = m == -INFINITY ? 0.0f : ExpNonPositive(m - m_new);  // 0 before the first page
  float sum = 0.0f;
  for (int64_t j = 0; j < PS; ++j) {
    const float e = ExpNonPositive(j < n ? s[j] - m_new : -87.0f);
    s[j] = j < n ? e : 0.0f;
    sum += s[j];
  }
  l = l * corr + sum;
  m = m_new;
  AddWeightedValues<ND>(o, corr, s, n, vp);
}

// q[0, n) = src[0, n) * scale, each an f32 product (as XLA's `q * scale` before the kernel was).
inline void ScaledQueries(const float* src, int64_t n, float scale, float* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = src[i] * scale;
}

// One (kv head, group) pair: `group` query heads over the row's keys. NK = ND = 0: any page
// size and head_dim. Else a page holds NK * kLanes keys and head_dim is ND * kLanes, and every
// loop's trip count is known to the compiler: a query's score against a key is ND vector
// multiply-adds and one lane sum, computed for all the page's slots, then FixedSoftmaxPage.
template <int NK, int ND>
void AttendOne(const Args& a, int64_t h, int64_t g, float* scores, float* m, float* l, float* q) {
  constexpr bool kFixed = NK > 0;
  const int64_t G = a.group;
  const int64_t D = kFixed ? ND * kLanes : a.head_dim, PS = kFixed ? NK * kLanes : a.page_size;
  const int32_t t = a.q_idx[g];
  if (t < 0 || t >= a.tokens1 - 1) return;  // a padding group; its token's row (if any) is zeroed up front
  float* o = a.out + ((t * a.kv_heads + h) * G) * D;
  const int32_t last = a.pos[t];
  if (last < 0) return;  // a padding token: zeros
  ScaledQueries(a.q + ((t * a.kv_heads + h) * a.q_group) * D, G * D, a.scale, q);
  const int32_t* table = a.page_table + static_cast<int64_t>(a.row[g]) * a.max_pages;
  for (int64_t i = 0; i < G; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  const int64_t pages = std::min<int64_t>(last / PS + 1, a.max_pages);
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t page = std::clamp<int64_t>(table[p], 0, a.num_pages - 1);
    const int64_t flat = a.page_base[h] + page;
    const float* kp = a.k + flat * PS * D;
    const float* vp = a.v + flat * PS * D;
    PrefetchAhead(a.k, a.v, a.page_base[h], table, a.num_pages, PS * D, p, pages);
    const int64_t n = std::min<int64_t>(PS, last + 1 - p * PS);  // keys of this page at or before `last`
    for (int64_t i = 0; i < G; ++i) {
      const float* qi = q + i * D;
      float* s = scores + i * PS;
      if constexpr (NK == 1) {  // one vector of keys: scores folded into one vector
        Vec qv[ND], acc[kLanes];
        for (int c = 0; c < ND; ++c) qv[c] = Load(qi + c * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) {
          Vec a = qv[0] * Load(kp + j * D);
          for (int c = 1; c < ND; ++c) a += qv[c] * Load(kp + j * D + c * kLanes);
          acc[BitReverse(j)] = a;
        }
        VecSoftmaxPage<ND>(TreeSum(acc), n, m[i], l[i], o + i * D, vp);
      } else if constexpr (kFixed) {
        Vec qv[ND];
        for (int c = 0; c < ND; ++c) qv[c] = Load(qi + c * kLanes);
        for (int64_t j = 0; j < NK * kLanes; ++j) {
          Vec acc = qv[0] * Load(kp + j * D);
          for (int c = 1; c < ND; ++c) acc += qv[c] * Load(kp + j * D + c * kLanes);
          s[j] = HSum(acc);
        }
        FixedSoftmaxPage<NK, ND>(s, n, m[i], l[i], o + i * D, vp);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kp + j * D;
          float acc = 0.0f;
          for (int64_t d = 0; d < D; ++d) acc += qi[d] * kj[d];
          s[j] = acc;
        }
        SoftmaxPage(s, n, m[i], l[i], o + i * D, vp, D);
      }
    }
  }
  Normalize(o, l, G, D);
}

// The shapes the fixed-size routines are built for: a page of NK vectors of keys, head_dim ND
// vectors. ForFixedShape returns pick(FixedShape<NK, ND>{}) for this page size and head_dim if
// it is one of them, else `other`; the single and the block lists pick their routines from it.
template <int NK, int ND>
struct FixedShape {
  static constexpr int kNK = NK, kND = ND;
};

template <typename R, typename Pick>
R ForFixedShape(int64_t page_size, int64_t head_dim, Pick pick, R other) {
  if (page_size == kLanes) {
    if (head_dim == kLanes) return pick(FixedShape<1, 1>{});
    if (head_dim == 2 * kLanes) return pick(FixedShape<1, 2>{});
    if (head_dim == 4 * kLanes) return pick(FixedShape<1, 4>{});
    if (head_dim == 8 * kLanes) return pick(FixedShape<1, 8>{});
  }
  if (page_size == 2 * kLanes) {
    if (head_dim == 2 * kLanes) return pick(FixedShape<2, 2>{});
    if (head_dim == 4 * kLanes) return pick(FixedShape<2, 4>{});
    if (head_dim == 8 * kLanes) return pick(FixedShape<2, 8>{});
    if (head_dim == 16 * kLanes) return pick(FixedShape<2, 16>{});
  }
  return other;
}

using OneFn = void (*)(const Args&, int64_t, int64_t, float*, float*, float*, float*);

// The single-list routine for this page size and head_dim: fixed-size where ForFixedShape
// has one, else the general one.
OneFn PickOne(int64_t page_size, int64_t head_dim) {
  return ForFixedShape<OneFn>(
      page_size, head_dim, [](auto s) -> OneFn { return AttendOne<decltype(s)::kNK, decltype(s)::kND>; },
      AttendOne<0, 0>);
}

// Work items [begin, end) of the kv_heads * capacity pairs.
void AttendRange(const Args& a, int64_t begin, int64_t end) {
  std::vector<float> scores(a.group * a.page_size), m(a.group), l(a.group), q(a.group * a.head_dim);
  const OneFn attend = PickOne(a.page_size, a.head_dim);
  for (int64_t w = begin; w < end; ++w)
    attend(a, w / a.capacity, w % a.capacity, scores.data(), m.data(), l.data(), q.data());
}

ffi::Error SingleGroupsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos,
                            ffi::Buffer<ffi::S32> q_idx, ffi::Buffer<ffi::S32> row,
                            ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_base, int64_t num_pages,
                            float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto td = page_table.dimensions();
  const auto kd = k.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 4 || td.size() != 2 || kd.size() != 2) {
    return ffi::Error::InvalidArgument("cbjax_single_groups: q must be 4-D, page_table and k 2-D");
  }
  if (od.size() != 4 || od[0] != qd[0] || od[1] != qd[1] || od[2] < 1 || od[2] > qd[2] || od[3] != qd[3]) {
    return ffi::Error::InvalidArgument(
        "cbjax_single_groups: out must be [tokens, kv_heads, group, head_dim] with q [tokens, kv_heads, group or more, "
        "head_dim]");
  }
  Args a{q.typed_data(),     pos.typed_data(),  q_idx.typed_data(), row.typed_data(),
         page_table.typed_data(), k.typed_data(), v.typed_data(),     page_base.typed_data(),
         out->typed_data(), qd[1], qd[0] + 1, od[2], qd[3],
         static_cast<int64_t>(q_idx.element_count()), td[1], kd[1] / qd[3], num_pages, scale, qd[2]};
  // tokens in no group keep zeros; each group's token row is written whole
  std::memset(out->typed_data(), 0, static_cast<size_t>(out->element_count()) * sizeof(float));
  const int64_t work = a.kv_heads * a.capacity;
  // Split only when there is enough work to pay for handing a share to other threads.
  const int64_t threads = work >= 16 ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 8)) : 1;
  const int64_t chunks = threads > 1 ? std::min<int64_t>(work, threads * 4) : 1;
  cbjax_native::RunChunks(pool, threads, chunks,
                          [a, work, chunks](int64_t c) { AttendRange(a, work * c / chunks, work * (c + 1) / chunks); });
  return ffi::Error::Success();
}

// ---- the block list: groups of up to `block` consecutive new tokens of one row ----

struct BlockArgs {
  const float* q;
  const int32_t* pos;
  const int32_t* q_idx;  // [capacity, block]
  const int32_t* row;
  const int32_t* page_table;
  const float* k;
  const float* v;
  const int32_t* page_base;
  float* out;  // token order [tokens, kv_heads, group, head_dim]
  int64_t kv_heads, tokens1, group, head_dim, capacity, block, max_pages, page_size, num_pages;
  float scale;
  int64_t q_group;  // as Args's
};

// Scratch of one thread: a page's keys transposed [head_dim, page_size], the scores of one
// query, each query's running max and sum, and the group's scaled queries and output rows
// [block, group, head_dim].
struct BlockScratch {
  std::vector<float> kt, s, m, l, q, o;
  std::vector<int32_t> qpos;
  explicit BlockScratch(const BlockArgs& a)
      : kt(a.head_dim * a.page_size), s(a.page_size), m(a.block * a.group), l(a.block * a.group),
        q(a.block * a.group * a.head_dim), o(a.block * a.group * a.head_dim), qpos(a.block) {}
};

constexpr int kTileRows = 8;  // query rows scored together against a page's keys

// One page for R <= kTileRows query rows r[0, R) of a block group, when the page holds NK * kLanes keys
// and head_dim is ND * kLanes: the scores of R queries as R x NK vectors (the keys transposed in
// kt), the softmax update of running max m[r] and sum l[r], and o[r] += p v with each row's ND
// output vectors in registers. nb[i]: row i's keys on the page (a prefix); rows with none are
// skipped by the caller.
template <int R, int NK, int ND>
inline void PageRows(const float* const* q, const float* kt, const float* vp, const int64_t* nb, const int64_t* r,
                     float* m, float* l, float* o) {
  constexpr int PS = NK * kLanes, D = ND * kLanes;
  Vec s[R][NK];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NK; ++c) s[i][c] = Vec{};
  for (int d = 0; d < D; ++d) {
    Vec k[NK];
    for (int c = 0; c < NK; ++c) k[c] = Load(kt + d * PS + c * kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec qd = Splat(q[i][d]);
      for (int c = 0; c < NK; ++c) s[i][c] += qd * k[c];
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float p[PS];
    for (int c = 0; c < NK; ++c) Store(p + c * kLanes, s[i][c]);
    float& mi = m[r[i]];
    float& li = l[r[i]];
    float page_max = -INFINITY;
    for (int j = 0; j < nb[i]; ++j) page_max = std::max(page_max, p[j]);
    const float m_new = std::max(mi, page_max);
    const float corr = mi == -INFINITY ? 0.0f : ExpNonPositive(mi - m_new);
    float sum = 0.0f;
    for (int j = 0; j < PS; ++j) {
      const float e = ExpNonPositive(p[j] - m_new);
      p[j] = j < nb[i] ? e : 0.0f;
      sum += p[j];
    }
    li = li * corr + sum;
    mi = m_new;
    AddWeightedValues<ND>(o + r[i] * D, corr, p, nb[i], vp);
  }
}

using PageFn = void (*)(int, const float* const*, const float*, const float*, const int64_t*, const int64_t*,
                       float*, float*, float*);

template <int NK, int ND>
void PageAny(int rows, const float* const* q, const float* kt, const float* vp, const int64_t* nb, const int64_t* r,
             float* m, float* l, float* o) {
  switch (rows) {
    case 8: PageRows<8, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 7: PageRows<7, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 6: PageRows<6, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 5: PageRows<5, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 4: PageRows<4, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 3: PageRows<3, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    case 2: PageRows<2, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
    default: PageRows<1, NK, ND>(q, kt, vp, nb, r, m, l, o); break;
  }
}

// The vectorized page routine for this page size and head_dim, or nullptr (the scalar loops).
PageFn FastPage(int64_t page_size, int64_t head_dim) {
  return ForFixedShape<PageFn>(
      page_size, head_dim, [](auto s) -> PageFn { return PageAny<decltype(s)::kNK, decltype(s)::kND>; }, nullptr);
}

// The group's rows `o` [block, group, head_dim] to the output in token order: each real
// token's rows at its token; padding slots write nothing.
void StoreBlock(const BlockArgs& a, int64_t h, int64_t g, const float* o) {
  const int64_t B = a.block, G = a.group, D = a.head_dim;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t t = a.q_idx[g * B + b];
    if (t < 0 || t >= a.tokens1 - 1) continue;
    std::copy(o + b * G * D, o + (b + 1) * G * D, a.out + ((t * a.kv_heads + h) * G) * D);
  }
}

// One (kv head, group) pair: block x group query rows over the row's keys, each query causal
// to its own position. Per page the keys are transposed once, so a query's scores are one
// vector multiply-add per head dimension over the page's keys.
void AttendBlock(const BlockArgs& a, int64_t h, int64_t g, BlockScratch& sc) {
  const int64_t B = a.block, G = a.group, D = a.head_dim, PS = a.page_size;
  float* o = sc.o.data();
  std::fill(o, o + B * G * D, 0.0f);
  int32_t last = -1;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t t = a.q_idx[g * B + b];
    sc.qpos[b] = (t >= 0 && t < a.tokens1) ? a.pos[t] : -1;
    last = std::max(last, sc.qpos[b]);
  }
  if (last < 0) return;  // a padding group
  for (int64_t b = 0; b < B; ++b)  // the real tokens' queries, scaled, as [block, group, head_dim]
    if (sc.qpos[b] >= 0)
      ScaledQueries(a.q + ((a.q_idx[g * B + b] * a.kv_heads + h) * a.q_group) * D, G * D, a.scale,
                    sc.q.data() + b * G * D);
  std::fill(sc.m.begin(), sc.m.end(), -INFINITY);
  std::fill(sc.l.begin(), sc.l.end(), 0.0f);
  const int32_t* table = a.page_table + static_cast<int64_t>(a.row[g]) * a.max_pages;
  const int64_t pages = std::min<int64_t>(last / PS + 1, a.max_pages);
  float* kt = sc.kt.data();
  float* s = sc.s.data();
  const PageFn fast = FastPage(PS, D);
  for (int64_t p = 0; p < pages; ++p) {
    const int64_t flat = a.page_base[h] + std::clamp<int64_t>(table[p], 0, a.num_pages - 1);
    const float* kp = a.k + flat * PS * D;
    const float* vp = a.v + flat * PS * D;
    PrefetchAhead(a.k, a.v, a.page_base[h], table, a.num_pages, PS * D, p, pages);
    const int64_t n = std::min<int64_t>(PS, last + 1 - p * PS);  // keys at or before the group's last position
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * PS + j] = kp[j * D + d];
    for (int64_t j = n; j < PS; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * PS + j] = 0.0f;  // unwritten keys: finite scores, weight 0
    if (fast != nullptr) {
      // rows in tiles of kTileRows (query rows r = b * G + i), skipping rows with no key on this page
      const float* qs[kTileRows];
      int64_t nbs[kTileRows], rs[kTileRows];
      int t = 0;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t nb = std::min<int64_t>(n, sc.qpos[b] + 1 - p * PS);
        if (nb <= 0) continue;
        for (int64_t i = 0; i < G; ++i) {
          qs[t] = sc.q.data() + (b * G + i) * D;
          nbs[t] = nb;
          rs[t] = b * G + i;
          if (++t == kTileRows) {
            fast(kTileRows, qs, kt, vp, nbs, rs, sc.m.data(), sc.l.data(), o);
            t = 0;
          }
        }
      }
      if (t > 0) fast(t, qs, kt, vp, nbs, rs, sc.m.data(), sc.l.data(), o);
      continue;
    }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nb = std::min<int64_t>(n, sc.qpos[b] + 1 - p * PS);  // this query's keys on the page
      if (nb <= 0) continue;
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = b * G + i;
        const float* qr = sc.q.data() + r * D;
        for (int64_t j = 0; j < PS; ++j) s[j] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qr[d];
          const float* ktd = kt + d * PS;
          for (int64_t j = 0; j < PS; ++j) s[j] += qd * ktd[j];
        }
        SoftmaxPage(s, nb, sc.m[r], sc.l[r], o + r * D, vp, D);
      }
    }
  }
  Normalize(o, sc.l.data(), B * G, D);
  StoreBlock(a, h, g, o);
}

// "cbjax_block_groups_into": the block list in token order, into `base` [tokens, kv_heads, group,
// head_dim] (aliased to the output): each block group's real tokens are written, every other
// row keeps base's value.
ffi::Error BlockGroupsIntoImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos,
                               ffi::Buffer<ffi::S32> q_idx, ffi::Buffer<ffi::S32> row,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::S32> page_base, ffi::Buffer<ffi::F32> base, int64_t num_pages,
                               float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto id = q_idx.dimensions();
  const auto td = page_table.dimensions();
  const auto kd = k.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 4 || id.size() != 2 || td.size() != 2 || kd.size() != 2) {
    return ffi::Error::InvalidArgument("cbjax_block_groups_into: q must be 4-D, q_idx, page_table and k 2-D");
  }
  if (od.size() != 4 || od[0] != qd[0] || od[1] != qd[1] || od[2] < 1 || od[2] > qd[2] || od[3] != qd[3]) {
    return ffi::Error::InvalidArgument(
        "cbjax_block_groups_into: base and out must be [tokens, kv_heads, group, head_dim] with q [tokens, kv_heads, "
        "group or more, head_dim]");
  }
  if (base.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("cbjax_block_groups_into: base must be out's shape");
  }
  if (base.typed_data() != out->typed_data()) {  // not aliased (XLA kept base alive): start from a copy
    std::memcpy(out->typed_data(), base.typed_data(), static_cast<size_t>(base.element_count()) * sizeof(float));
  }
  BlockArgs a{q.typed_data(), pos.typed_data(), q_idx.typed_data(), row.typed_data(), page_table.typed_data(),
              k.typed_data(), v.typed_data(), page_base.typed_data(), out->typed_data(), qd[1], qd[0] + 1, od[2],
              qd[3], id[0], id[1], td[1], kd[1] / qd[3], num_pages, scale, qd[2]};
  const int64_t work = a.kv_heads * a.capacity;
  const int64_t threads = work >= 2 ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 8)) : 1;
  const int64_t chunks = threads > 1 ? std::min<int64_t>(work, threads * 4) : 1;
  cbjax_native::RunChunks(pool, threads, chunks, [a, work, chunks](int64_t c) {
    BlockScratch sc(a);
    for (int64_t w = work * c / chunks; w < work * (c + 1) / chunks; ++w) AttendBlock(a, w / a.capacity, w % a.capacity, sc);
  });
  return ffi::Error::Success();
}

// ---- "cbjax_write_kv": one layer's new keys and values into the cache, in place ----
// qkv f32[tokens, kv_heads, group + 2, head_dim] is the fused q/k/v product (each kv head's
// query heads, then its k head, then its v head); token t's k and v rows go to slot write_idx[t]
// (page * page_size + offset; negative counts from the end, past the end is dropped, as XLA's
// scatter) of layer `layer` (clipped) of k and v [layers, kv_heads, pages, page_size, head_dim],
// aliased to the outputs. The XLA path slices k and v out of the product, copies them and
// scatters them in two ops split over threads, with their index arithmetic in more.
ffi::Error WriteKVImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::S32> write_idx, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> k_out,
                       ffi::ResultBuffer<ffi::F32> v_out) {
  const auto qd = qkv.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || qd[2] < 3 || kd.size() != 5 || vd.size() != 5 || kd[1] != qd[1] || kd[4] != qd[3] ||
      write_idx.element_count() != qd[0] || k.element_count() != v.element_count() ||
      k_out->element_count() != k.element_count() || v_out->element_count() != v.element_count()) {
    return ffi::Error::InvalidArgument(
        "cbjax_write_kv: qkv must be [tokens, kv_heads, group + 2, head_dim], write_idx [tokens], k and v (and the "
        "outputs) [layers, kv_heads, pages, page_size, head_dim] alike");
  }
  for (auto [in, out] : {std::pair{&k, &k_out}, std::pair{&v, &v_out}}) {
    if (in->typed_data() != (*out)->typed_data()) {  // not aliased: start from a copy (slow, but right)
      std::memcpy((*out)->typed_data(), in->typed_data(), static_cast<size_t>(in->element_count()) * sizeof(float));
    }
  }
  const int64_t tokens = qd[0], heads = qd[1], q_group = qd[2], D = qd[3];
  const int64_t slots = kd[2] * kd[3];  // per (layer, kv head)
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  const float* src = qkv.typed_data();
  float* kp = k_out->typed_data();
  float* vp = v_out->typed_data();
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t slot = write_idx.typed_data()[t];
    if (slot < 0) slot += slots;
    if (slot < 0 || slot >= slots) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = src + ((t * heads + h) * q_group + q_group - 2) * D;  // its k, then its v
      const int64_t at = ((l * heads + h) * slots + slot) * D;
      std::copy(row, row + D, kp + at);
      std::copy(row + D, row + 2 * D, vp + at);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxWriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [tokens, kv_heads, group + 2, head_dim]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_idx [tokens]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [layers, kv_heads, pages, page_size, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k, aliased
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxBlockGroupsInto, BlockGroupsIntoImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_idx [capacity, block]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_base
                                  .Arg<ffi::Buffer<ffi::F32>>()  // base [tokens, kv_heads, group, head_dim]
                                  .Attr<int64_t>("num_pages")
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: base with the block list's tokens

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxSingleGroups, SingleGroupsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_idx
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_base
                                  .Attr<int64_t>("num_pages")
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [tokens, kv_heads, group, head_dim]
