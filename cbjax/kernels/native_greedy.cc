// Greedy tokens from a step's logits on the CPU: an XLA FFI custom call.
//
// cbjax.kernels.native builds this file beside the others and registers it as the custom call
// target "cbjax_greedy". XLA:CPU runs a row's maximum, the first index that reaches it and the
// check that every logit is finite as three scalar reductions, each a chain of dependent
// compare-selects over the vocabulary: about 0.3 ms for [32, 4096] logits on this project's
// CPU, a tenth of a decode step. Here one pass per row keeps a vector of running maxima with the
// index where each lane first reached its maximum, and a running flag of any non-finite lane.
//
// Inputs:
//   logits f32[rows, vocab]
//   live   s32[]               rows to read, clipped to [0, rows); the rows after it get 0
// Output:
//   tokens s32[rows]           each live row's first index of its maximum, or -1 where any of
//                              its logits is NaN or infinite (as jnp.argmax on a finite row)
//
// The maximum does not depend on the order of comparisons, and each lane keeps the first index
// at which it reached its own maximum, so the smallest such index among the lanes that hold the
// row's maximum is the row's first: the same as the scalar reductions, bit for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "native_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using cbjax_native::IVec;
using cbjax_native::kLanes;
using cbjax_native::Load;
using cbjax_native::Splat;
using cbjax_native::Vec;

// The row's token (see the top of the file).
int32_t RowToken(const float* x, int64_t n) {
  const int64_t body = n / kLanes * kLanes;
  bool bad = false;
  float best = x[0];
  int32_t best_idx = 0;
  if (body > 0) {
    Vec m = Load(x);
    IVec idx = cbjax_native::kFold.iota;
    IVec nonfinite = (m - m) != Splat(0.0f);  // inf - inf and NaN - NaN are NaN
    for (int64_t j = kLanes; j < body; j += kLanes) {
      const Vec v = Load(x + j);
      nonfinite |= (v - v) != Splat(0.0f);
      const IVec up = v > m;  // strictly: a lane keeps its first index of a tie
      m = up ? v : m;
      idx = up ? cbjax_native::kFold.iota + static_cast<int32_t>(j) : idx;
    }
    best = m[0];
    best_idx = idx[0];
    for (int i = 0; i < kLanes; ++i) {
      bad = bad || nonfinite[i] != 0;
      if (m[i] > best || (m[i] == best && idx[i] < best_idx)) {
        best = m[i];
        best_idx = idx[i];
      }
    }
  }
  for (int64_t j = body; j < n; ++j) {  // the last n % kLanes, in order: a tie keeps the earlier index
    const float v = x[j];
    bad = bad || !std::isfinite(v);
    if (v > best) {
      best = v;
      best_idx = static_cast<int32_t>(j);
    }
  }
  return bad ? -1 : best_idx;
}

ffi::Error GreedyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::S32> tokens) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || ld[1] < 1 || tokens->element_count() != ld[0]) {
    return ffi::Error::InvalidArgument("cbjax_greedy: logits must be [rows, vocab] with vocab >= 1, tokens [rows]");
  }
  const int64_t rows = ld[0], n = ld[1];
  const int64_t used = std::clamp<int64_t>(live.typed_data()[0], 0, rows);
  const float* x = logits.typed_data();
  int32_t* out = tokens->typed_data();
  std::fill(out + used, out + rows, 0);
  // A thread pays off past a few hundred thousand logits (tens of microseconds).
  const int64_t threads = std::min<int64_t>({static_cast<int64_t>(pool.num_threads()), used, used * n / 262144});
  const int64_t chunks = threads > 1 ? std::min<int64_t>(used, threads * 2) : 1;
  cbjax_native::RunChunks(pool, threads, chunks, [=](int64_t c) {
    for (int64_t r = used * c / chunks; r < used * (c + 1) / chunks; ++r) out[r] = RowToken(x + r * n, n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxGreedy, GreedyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [rows, vocab]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens [rows]
