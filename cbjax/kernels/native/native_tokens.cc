// A step's tokens on the CPU, in and out: XLA FFI custom calls.
//
// cbjax.kernels.native builds this file beside the others and registers its targets.
//
// "cbjax_embed": the step's input rows. Each token is the batch's own, or, where the packer fed
// it from the step before (feed >= 0), that step's output token at row `feed`, still on the
// device; its row of the embedding table is copied out. XLA:CPU ran this select-and-gather as
// one fusion split over two threads (it sizes the work by the whole table), slow for the few
// kilobytes it moves (docs/cpu_kernels.md).
//
// Inputs:
//   table  f32[vocab, d]       the embedding table
//   tokens s32[T]              the batch's tokens
//   feed   s32[T]              the previous step's row for each token, or -1
//   prev   s32[R]              the previous step's output tokens
// Output:
//   x      f32[T, d]           table[token] for each token, the index as jnp's: a negative one
//                              counts from the end, then it is clipped to [0, vocab)
//
// "cbjax_greedy": greedy tokens from a step's logits. XLA:CPU runs a row's maximum, the first
// index that reaches it and the check that every logit is finite as three scalar reductions,
// each a chain of dependent compare-selects over the vocabulary, a large share of a small decode
// step (docs/cpu_kernels.md). Here one pass per row keeps a vector of running maxima with the
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

ffi::Error EmbedImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> feed,
                     ffi::Buffer<ffi::S32> prev, ffi::ResultBuffer<ffi::F32> x) {
  const auto td = table.dimensions();
  const auto xd = x->dimensions();
  const int64_t t = tokens.element_count(), r = prev.element_count();
  if (td.size() != 2 || td[0] < 1 || xd.size() != 2 || xd[0] != t || xd[1] != td[1] || feed.element_count() != t ||
      r < 1) {
    return ffi::Error::InvalidArgument(
        "cbjax_embed: table must be [vocab, d] with vocab >= 1, tokens and feed [T], prev [R >= 1], x [T, d]");
  }
  const int64_t vocab = td[0], d = td[1];
  for (int64_t i = 0; i < t; ++i) {
    const int32_t f = feed.typed_data()[i];
    int64_t token = f >= 0 ? prev.typed_data()[std::min<int64_t>(f, r - 1)] : tokens.typed_data()[i];
    if (token < 0) token += vocab;
    token = std::clamp<int64_t>(token, 0, vocab - 1);
    std::copy(table.typed_data() + token * d, table.typed_data() + (token + 1) * d, x->typed_data() + i * d);
  }
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxEmbed, EmbedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table [vocab, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tokens [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // feed [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // prev [R]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x [T, d]

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxGreedy, GreedyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [rows, vocab]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens [rows]
