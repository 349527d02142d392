// What the native kernels share: a vector of the CPU's float lanes, and splitting a kernel's
// work over threads.
//
// Vec is kLanes floats (16 with AVX-512, else 8; GCC vector extensions: GCC builds these
// sources, clang does not), loaded and stored unaligned.
//
// RunChunks(pool, threads, chunks, fn) calls fn(c) once for each chunk c in [0, chunks) and
// returns when every chunk is done; fn must be safe to call concurrently. This thread claims
// chunks alongside a Team of helper threads. A decode step runs some twenty short kernels one
// after another; a helper that slept between them would be woken for each (a wake costs about
// as much as the kernel on a virtual machine). So an idle helper first waits up to the team's
// spin time (CBJAX_NATIVE_SPIN_US, default kSpinMicros; 0: none), yielding its core to any
// other runnable thread, and then blocks on a condition variable until the next job: between
// steps, and in a process that stops calling the kernels, the helpers sleep.
// docs/cpu_kernels.md has the measurement behind the default. When another thread holds the
// team (two kernels at once), the job falls back to XLA's pool: this thread and threads - 1
// pool tasks claim chunks, and a task that starts late finds none and returns.
#ifndef CBJAX_KERNELS_NATIVE_COMMON_H_
#define CBJAX_KERNELS_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

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
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

// exp(x) for x <= 0 (the softmax's scores less their max; SiLU's -|x|), vectorizable (the
// library's expf is a scalar call and took most of the attention's time): x = n ln2 + u with
// |u| <= ln2 / 2 (Cody-Waite), e^u by its Taylor series to u^7 (relative error below 1e-8, under
// float's rounding), times 2^n built in the exponent bits. Below -87 it returns 2^-126 scaled
// (about 1e-38, no denormals); NaN stays NaN.
// ExpOfRemainder: e^u for x = n ln2 + u (n an integer-valued T), the steps between the reduction
// and the scaling: float or a vector of floats alike.
// Both are static: each source compiles its own copy with its own flags (the attention's
// reassociate; the matmul's do not), where one inline definition would serve both.
template <typename T>
static inline T ExpOfRemainder(T x, T n) {
  const T u = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  T p = T{} + 1.0f / 5040.0f;
  p = p * u + 1.0f / 720.0f;
  p = p * u + 1.0f / 120.0f;
  p = p * u + 1.0f / 24.0f;
  p = p * u + 1.0f / 6.0f;
  p = p * u + 0.5f;
  p = p * u + 1.0f;
  return p * u + 1.0f;
}

// exp(x) on each lane, x <= 0 (above).
static inline Vec ExpNonPositiveVec(Vec x) {
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  const Vec t = x * 1.44269504088896341f + 0.5f;
  Vec n = __builtin_convertvector(__builtin_convertvector(t, IVec), Vec);  // truncated toward zero
  n = n > t ? n - 1.0f : n;                                               // floor
  const Vec p = ExpOfRemainder(x, n);
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// ---- kLanes vectors' lane sums as one vector (TreeSum) ----
// The vectors fold pairwise in log2(kLanes) shuffle-add stages into one vector of kLanes sums, in
// place of kLanes chains of kLanes dependent scalar adds: the attention's scores of a page of
// keys, the tied LM head's outputs. Each sum runs in a tree over its lanes.

constexpr int kFoldStages = kLanes == 16 ? 4 : 3;

// Stage k (half width w = kLanes >> (k + 1)) folds vectors a and b: in each block of 2w lanes the
// first w output lanes are a's lane pairs (s + o, s + o + w) summed, the last w b's.
struct FoldMasks {
  IVec first[kFoldStages], second[kFoldStages];
  IVec iota;
};

static FoldMasks MakeFoldMasks() {
  FoldMasks f;
  for (int k = 0; k < kFoldStages; ++k) {
    const int w = kLanes >> (k + 1);
    for (int lane = 0; lane < kLanes; ++lane) {
      const int block = lane - lane % (2 * w), o = lane % (2 * w);
      f.first[k][lane] = o < w ? block + o : kLanes + block + o - w;
      f.second[k][lane] = f.first[k][lane] + w;
    }
  }
  for (int lane = 0; lane < kLanes; ++lane) f.iota[lane] = lane;
  return f;
}

static const FoldMasks kFold = MakeFoldMasks();

// The folds leave vector v's lane sum in lane BitReverse(v): TreeSum's caller stores the
// j-th vector at v[BitReverse(j)], so that lane j holds its sum.
constexpr int BitReverse(int j) {
  int r = 0;
  for (int b = 0; b < kFoldStages; ++b) r |= ((j >> b) & 1) << (kFoldStages - 1 - b);
  return r;
}

// Lane j of the result: the sum of v[j]'s lanes, for v in bit-reversed order (above); v is scratch.
static inline Vec TreeSum(Vec* v) {
  int count = kLanes;
#pragma GCC unroll 4
  for (int k = 0; k < kFoldStages; ++k) {
    count /= 2;
#pragma GCC unroll 8
    for (int i = 0; i < count; ++i) {
      v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], kFold.first[k]) +
             __builtin_shuffle(v[2 * i], v[2 * i + 1], kFold.second[k]);
    }
  }
  return v[0];
}

// The helpers of RunChunks (see the top of the file); one team per process.
class Team {
 public:
  // The team, started on first use with `helpers` threads (more are not added later).
  static Team& Get(int64_t helpers) {
    static Team* team = new Team(helpers);  // never destroyed: its threads run until the process exits
    return *team;
  }

  // fn(c) for c in [0, chunks) on this thread and the helpers. False, with nothing run, when
  // another thread is using the team or the chunks do not fit the state word.
  template <typename Fn>
  bool Run(int64_t chunks, const Fn& fn) {
    if (threads_.empty() || chunks >= kMaxChunks) return false;
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    ctx_ = &fn;
    call_ = [](const void* f, int64_t c) { (*static_cast<const Fn*>(f))(c); };
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & 0xffffffffu;
    // Publishes ctx_ and call_ with the job; sequentially consistent with the helpers' check
    // before they sleep, so either they see the job or this thread sees them asleep.
    state_.store(gen_ << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    for (int64_t c; (c = Claim(gen_)) >= 0;) {
      fn(c);
      done_.fetch_add(1, std::memory_order_release);
    }
    while (done_.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
    return true;
  }

 private:
  static constexpr int64_t kMaxChunks = 1 << 16;
  static constexpr int64_t kSpinMicros = 50;

  static std::chrono::microseconds SpinTime() {
    const char* env = std::getenv("CBJAX_NATIVE_SPIN_US");
    return std::chrono::microseconds(env != nullptr ? std::max<long long>(0, std::atoll(env)) : kSpinMicros);
  }

  explicit Team(int64_t helpers) : spin_(SpinTime()) {
    for (int64_t i = 0; i < helpers; ++i) threads_.emplace_back([this] { Help(); });
    for (auto& t : threads_) t.detach();
  }

  // The next unclaimed chunk of job `gen`, or -1 when it has none left (or a later job runs).
  int64_t Claim(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = s & 0xffff, chunks = (s >> 16) & 0xffff;
      if ((s >> 32) != gen || next >= chunks) return -1;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return static_cast<int64_t>(next);
    }
  }

  void Help() {
    uint64_t seen = 0;  // the last job with no chunk left for us
    auto idle = std::chrono::steady_clock::now();
    for (;;) {
      const uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) {
        if (const int64_t c = Claim(gen); c >= 0) {
          call_(ctx_, c);  // the job cannot end, nor ctx_ change, before this chunk counts as done
          done_.fetch_add(1, std::memory_order_release);
          continue;
        }
        seen = gen;
        idle = std::chrono::steady_clock::now();
      }
      if (std::chrono::steady_clock::now() - idle < spin_) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const std::chrono::microseconds spin_;  // how long an idle helper waits before it blocks
  std::vector<std::thread> threads_;
  std::mutex run_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<uint64_t> state_{0};  // job generation (32 bits) | chunks (16) | next unclaimed chunk (16)
  std::atomic<int64_t> done_{0};
  uint64_t gen_ = 0;  // the current job's generation; written only under run_mu_
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t) = nullptr;
};

template <typename Fn>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t threads, int64_t chunks, const Fn& fn) {
  if (threads <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  if (Team::Get(std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), 8) - 1)).Run(chunks, fn)) return;
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
