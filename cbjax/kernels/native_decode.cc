// Paged attention of single-token query groups on the CPU: an XLA FFI custom call.
//
// cbjax.kernels.native builds this file with the system C++ compiler at first use and
// registers it as the custom call target "cbjax_single_groups". It runs the single list of
// the XLA ragged backend (cbjax.kernels.xla_ragged): each group is one query token, which
// attends over its row's keys 0 .. its position, read in place from the paged cache (no
// gather copies), with an online softmax per page. Keys past the position are never read,
// so unwritten slots (NaN in tests) and other rows' pages never reach the result.
//
// Inputs (row-major):
//   q          f32[kv_heads, tokens + 1, group, head_dim]  queries, already scaled
//   pos        s32[tokens + 1]                              each token's position; -1 for padding
//   q_idx      s32[capacity]                                the group's token; `tokens` for padding
//   row        s32[capacity]                                the group's page-table row
//   page_table s32[rows, max_pages]
//   k, v       f32[num_flat_pages, page_size * head_dim]    the cache, one page per row
//   page_base  s32[kv_heads]                                flat row of page 0 for each kv head
// Attributes: num_pages (pages per kv head of one layer; page ids are clipped to it).
// Output:
//   out        f32[kv_heads, capacity, group, head_dim]     zeros for padding groups
//
// The (kv head, group) pairs are split over XLA's intra-op thread pool, this thread included.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

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
};

// exp(x) for the softmax's x <= 0, vectorizable (the library's expf is a scalar call and took
// most of the kernel's time): x = n ln2 + u with |u| <= ln2 / 2 (Cody-Waite), e^u by its Taylor
// series to u^7 (relative error below 1e-8, under float's rounding), times 2^n built in the
// exponent bits. Below -87 it returns 2^-126 scaled (about 1e-38, no denormals); NaN stays NaN.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float u = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * u + 1.0f / 720.0f;
  p = p * u + 1.0f / 120.0f;
  p = p * u + 1.0f / 24.0f;
  p = p * u + 1.0f / 6.0f;
  p = p * u + 0.5f;
  p = p * u + 1.0f;
  p = p * u + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One (kv head, group) pair: `group` query heads over the row's keys.
void AttendOne(const Args& a, int64_t h, int64_t g, float* scores, float* m, float* l) {
  const int64_t G = a.group, D = a.head_dim, PS = a.page_size;
  float* o = a.out + ((h * a.capacity + g) * G) * D;
  std::fill(o, o + G * D, 0.0f);
  const int32_t t = a.q_idx[g];
  if (t < 0 || t >= a.tokens1 - 1) return;  // padding group
  const int32_t last = a.pos[t];
  if (last < 0) return;  // padding token
  const float* q = a.q + ((h * a.tokens1 + t) * G) * D;
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
    if (p + 1 < pages) {  // pages lie anywhere in the pool: fetch the next one while this one is read
      const int64_t next = (a.page_base[h] + std::clamp<int64_t>(table[p + 1], 0, a.num_pages - 1)) * PS * D;
      for (int64_t off = 0; off < PS * D; off += 16) {
        __builtin_prefetch(a.k + next + off);
        __builtin_prefetch(a.v + next + off);
      }
    }
    const int64_t n = std::min<int64_t>(PS, last + 1 - p * PS);  // keys of this page at or before `last`
    for (int64_t i = 0; i < G; ++i) {
      const float* qi = q + i * D;
      float* s = scores + i * PS;
      float page_max = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kp + j * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qi[d] * kj[d];
        s[j] = acc;
        page_max = std::max(page_max, acc);
      }
      const float m_new = std::max(m[i], page_max);
      const float corr = m[i] == -INFINITY ? 0.0f : ExpNonPositive(m[i] - m_new);  // 0 before the first page
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = ExpNonPositive(s[j] - m_new);
        sum += s[j];
      }
      l[i] = l[i] * corr + sum;
      m[i] = m_new;
      float* oi = o + i * D;
      for (int64_t d = 0; d < D; ++d) oi[d] *= corr;
      for (int64_t j = 0; j < n; ++j) {
        const float pj = s[j];
        const float* vj = vp + j * D;
        for (int64_t d = 0; d < D; ++d) oi[d] += pj * vj[d];
      }
    }
  }
  for (int64_t i = 0; i < G; ++i) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    float* oi = o + i * D;
    for (int64_t d = 0; d < D; ++d) oi[d] *= inv;
  }
}

// Work items [begin, end) of the kv_heads * capacity pairs.
void AttendRange(const Args& a, int64_t begin, int64_t end) {
  std::vector<float> scores(a.group * a.page_size), m(a.group), l(a.group);
  for (int64_t w = begin; w < end; ++w) {
    AttendOne(a, w / a.capacity, w % a.capacity, scores.data(), m.data(), l.data());
  }
}

ffi::Error SingleGroupsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos,
                            ffi::Buffer<ffi::S32> q_idx, ffi::Buffer<ffi::S32> row,
                            ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_base, int64_t num_pages,
                            ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto td = page_table.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4 || td.size() != 2 || kd.size() != 2) {
    return ffi::Error::InvalidArgument("cbjax_single_groups: q must be 4-D, page_table and k 2-D");
  }
  Args a{q.typed_data(),     pos.typed_data(),  q_idx.typed_data(), row.typed_data(),
         page_table.typed_data(), k.typed_data(), v.typed_data(),     page_base.typed_data(),
         out->typed_data(), qd[0], qd[1], qd[2], qd[3],
         static_cast<int64_t>(q_idx.element_count()), td[1], kd[1] / qd[3], num_pages};
  const int64_t work = a.kv_heads * a.capacity;
  // Split only when there is enough work to pay for handing a share to other threads.
  const int64_t threads = work >= 16 ? std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 8)) : 1;
  if (threads <= 1) {
    AttendRange(a, 0, work);
    return ffi::Error::Success();
  }
  // Workers claim chunks until none is left; this thread is one of them, so it never waits on a
  // task the pool has not started (a late task finds no chunk and returns). The state lives on
  // the heap, held by every task, so a task that starts after this call returned is safe.
  struct Shared {
    Args a;
    int64_t work, chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->a = a;
  shared->work = work;
  shared->chunks = std::min<int64_t>(work, threads * 4);
  auto worker = [shared] {
    Shared& st = *shared;
    for (int64_t c; (c = st.next.fetch_add(1, std::memory_order_relaxed)) < st.chunks;) {
      AttendRange(st.a, st.work * c / st.chunks, st.work * (c + 1) / st.chunks);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([worker] { worker(); });
  worker();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) {
    std::this_thread::yield();  // another worker finishes its last chunk
  }
  return ffi::Error::Success();
}

}  // namespace

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
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
