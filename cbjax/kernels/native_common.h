// What the native kernels share: a vector of the CPU's float lanes, and splitting a kernel's
// work over XLA's CPU intra-op thread pool.
//
// Vec is kLanes floats (16 with AVX-512, else 8; GCC vector extensions, so any CPU compiles it),
// loaded and stored unaligned.
//
// RunChunks(pool, threads, chunks, fn) calls fn(c) once for each chunk c in [0, chunks): this
// thread and threads - 1 pool tasks claim chunks until none is left, and it returns when every
// chunk is done. This thread is one of the workers, so it never waits on a task the pool has not
// started (a late task finds no chunk and returns); fn is copied into state every task holds, so
// a task that starts after RunChunks returned is safe. fn must be safe to call concurrently.

#ifndef CBJAX_KERNELS_NATIVE_COMMON_H_
#define CBJAX_KERNELS_NATIVE_COMMON_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace cbjax_native {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
inline Vec Splat(float s) { return Vec{} + s; }

template <typename Fn>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t threads, int64_t chunks, const Fn& fn) {
  if (threads <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  struct Shared {
    explicit Shared(const Fn& f, int64_t n) : fn(f), chunks(n) {}
    Fn fn;
    int64_t chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>(fn, chunks);
  auto worker = [shared] {
    Shared& st = *shared;
    for (int64_t c; (c = st.next.fetch_add(1, std::memory_order_relaxed)) < st.chunks;) {
      st.fn(c);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([worker] { worker(); });
  worker();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) {
    std::this_thread::yield();  // another worker finishes its last chunk
  }
}

}  // namespace cbjax_native

#endif  // CBJAX_KERNELS_NATIVE_COMMON_H_
