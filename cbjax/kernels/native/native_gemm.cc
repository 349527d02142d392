// f32 matmuls on the CPU, reading one layer of stacked weights in place: an XLA FFI custom call.
//
// cbjax.kernels.native builds this file beside native_decode.cc and registers it as the custom
// call target "cbjax_layer_matmul". A decode step multiplies a handful of token rows by every
// weight matrix; XLA:CPU pays a fixed cost on each such dot whatever its size, and inside the
// step's layer scan it first copies the layer's weights out of the stack (docs/cpu_kernels.md). Here each output tile keeps its rows x columns in registers over the whole
// contraction, so the weights stream once per row tile, straight from the stack; rows go in
// blocks that stay in the L2 cache while the column tiles pass (RowBlock), so a prefill of
// thousands of tokens runs as fast as XLA's blocked GEMM.
//
// Inputs (row-major):
//   x      f32[rows, k]
//   w      f32[layers, panels, k, P]   the weights in panel order (cbjax.kernels.native.to_panels):
//                                      panel p holds columns [p * P, (p + 1) * P) of the [k, n]
//                                      matrix, k rows of P floats, so a column tile streams its
//                                      weights contiguously; one panel of P = n is the plain
//                                      row-major matrix. layers may be 1 (an unstacked matrix).
//   layer  s32[]                       which layer of w; clipped to [0, layers)
//   live   s32[]                       rows to compute, clipped to [0, rows): the step's tokens
//                                      short of its bucket's padding; the rows after it are zeros
// Output:
//   y      f32[rows, n]                x @ w[layer], n = panels * P
//
// "cbjax_layer_matmul_glu" is the fused gate/up matmul with its SwiGLU: w's panels hold the gate's
// n / 2 columns, then the up's, and y f32[rows, n / 2] = silu(x @ gate) * (x @ up), each output
// tile's gate and up sums taken in registers and combined as they leave them (no [rows, n]
// product in memory, no XLA op after).
//
// "cbjax_matmul_nt" is x f32[rows, k] times w f32[n, k] transposed (the tied LM head: the
// embedding table contracted on its last axis, read in place rather than transposed), with
// the same `live` row count.
//
// Sums run over k in order for each output, one fused multiply-add at a time, so a row's
// result does not depend on the other rows or on the thread split. Column tiles are split over
// threads (RunChunks, native_common.h) when the product is large enough.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "native_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using cbjax_native::kLanes;
using cbjax_native::Load;
using cbjax_native::Splat;
using cbjax_native::Store;
using cbjax_native::Vec;

constexpr int64_t kPrefetch = 16;  // k rows of weights fetched ahead in Tile

struct Args {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, k, n;
  int64_t ld;  // floats from one k row of a panel to the next: the panel width (n for one panel)
  const float* residual = nullptr;  // [rows, n] added to the product as it is stored, or none
};

// acc = x[r0 : r0 + R] @ w[:, c0 : c0 + V * kLanes] with R x V vector accumulators; the columns
// lie within one panel.
template <int R, int V>
inline void Accumulate(const Args& a, int64_t r0, int64_t c0, Vec (&acc)[R][V]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = Vec{};
  const float* x = a.x + r0 * a.k;
  const float* w = a.w + c0 / a.ld * a.k * a.ld + c0 % a.ld;
  // Narrow panels stream contiguously, which the hardware prefetcher follows. In the plain
  // row-major matrix (one panel) consecutive k rows are n floats apart, for wide matrices a new
  // 4 KB page each, where it stops: there fetch kPrefetch rows ahead.
  const bool prefetch = a.ld == a.n;
  for (int64_t kk = 0; kk < a.k; ++kk) {
    if (prefetch && kk + kPrefetch < a.k)
      for (int j = 0; j < V; ++j) __builtin_prefetch(w + (kk + kPrefetch) * a.ld + j * kLanes);
    Vec b[V];
    for (int j = 0; j < V; ++j) b[j] = Load(w + kk * a.ld + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec s = Splat(x[i * a.k + kk]);
      for (int j = 0; j < V; ++j) acc[i][j] += s * b[j];
    }
  }
}

// y[r0 : r0 + R, c0 : c0 + V * kLanes] (plus the residual's, if any: one f32 add, as XLA's).
template <int R, int V>
inline void Tile(const Args& a, int64_t r0, int64_t c0) {
  Vec acc[R][V];
  Accumulate<R, V>(a, r0, c0, acc);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) {
      const int64_t at = (r0 + i) * a.n + c0 + j * kLanes;
      Store(a.y + at, a.residual == nullptr ? acc[i][j] : Load(a.residual + at) + acc[i][j]);
    }
}

// silu(g) * u lane by lane, silu(g) = g * sigmoid(g) as jax.nn.silu, the sigmoid from e = exp(-|g|)
// (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline Vec SiluTimes(Vec g, Vec u) {
  const Vec e = cbjax_native::ExpNonPositiveVec(g < Splat(0.0f) ? g : -g);
  const Vec sigmoid = (g < Splat(0.0f) ? e : Splat(1.0f)) / (e + 1.0f);
  return g * sigmoid * u;
}

// The SwiGLU epilogue: y[r0 : r0 + R, c0 : c0 + V * kLanes] (y's rows a.n / 2 wide) = silu of
// the gate columns c0 ... times the up columns a.n / 2 + c0 ... of w.
template <int R, int V>
inline void TileGlu(const Args& a, int64_t r0, int64_t c0) {
  const int64_t half = a.n / 2;
  Vec gate[R][V], up[R][V];
  Accumulate<R, V>(a, r0, c0, gate);
  Accumulate<R, V>(a, r0, half + c0, up);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) Store(a.y + (r0 + i) * half + c0 + j * kLanes, SiluTimes(gate[i][j], up[i][j]));
}

// The rotary embedding of a q/k/v product's tiles (cbjax.model.llama.rope, Hugging Face's
// rotate_half): each output row's head of head_dim columns, halves x1 and x2, becomes
// x1 * cos - x2 * sin, x2 * cos + x1 * sin with the row's cos and sin [head_dim]; in each run of
// `period` heads (a kv head's group of query heads, its k head, its v head) the last, v, is
// left as it is.
struct Rope {
  const float* cos;  // [rows, head_dim]
  const float* sin;
  int64_t head_dim, period;
};

// Tile's product, stored with the rotary embedding applied (a head never straddles a tile:
// the tile's width is a multiple of head_dim).
template <int R, int V>
inline void TileRope(const Args& a, const Rope& ro, int64_t r0, int64_t c0) {
  constexpr int64_t W = V * kLanes;
  Vec acc[R][V];
  Accumulate<R, V>(a, r0, c0, acc);
  const int64_t D = ro.head_dim, half = D / 2;
  alignas(64) float t[W];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < V; ++j) Store(t + j * kLanes, acc[i][j]);
    const float* cs = ro.cos + (r0 + i) * D;
    const float* sn = ro.sin + (r0 + i) * D;
    float* y = a.y + (r0 + i) * a.n + c0;
    for (int64_t h = 0; h < W; h += D) {
      if ((c0 + h) / D % ro.period == ro.period - 1) {  // a v head
        std::memcpy(y + h, t + h, static_cast<size_t>(D) * sizeof(float));
        continue;
      }
      for (int64_t d = 0; d < half; ++d) {
        y[h + d] = t[h + d] * cs[d] - t[h + half + d] * sn[d];
        y[h + half + d] = t[h + half + d] * cs[half + d] + t[h + d] * sn[half + d];
      }
    }
  }
}

// fn(rows, r, c) for each tile of columns [c0, c1) (a multiple of V * kLanes wide) by rows
// [r0, r1): rows a std::integral_constant of 6, or of the 1-5 left at the end.
template <int V, typename Fn>
void ForTiles(int64_t c0, int64_t c1, int64_t r0, int64_t r1, const Fn& fn) {
  for (int64_t c = c0; c < c1; c += V * kLanes) {
    int64_t r = r0;
    for (; r + 6 <= r1; r += 6) fn(std::integral_constant<int, 6>{}, r, c);
    switch (r1 - r) {
      case 5: fn(std::integral_constant<int, 5>{}, r, c); break;
      case 4: fn(std::integral_constant<int, 4>{}, r, c); break;
      case 3: fn(std::integral_constant<int, 3>{}, r, c); break;
      case 2: fn(std::integral_constant<int, 2>{}, r, c); break;
      case 1: fn(std::integral_constant<int, 1>{}, r, c); break;
      default: break;
    }
  }
}

// Columns [c0, c1) whose width is a multiple of V * kLanes, rows [r0, r1); kGlu: TileGlu's
// output columns.
template <int V, bool kGlu = false>
void Columns(const Args& a, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  ForTiles<V>(c0, c1, r0, r1, [&a](auto rows, int64_t r, int64_t c) {
    constexpr int R = decltype(rows)::value;
    if constexpr (kGlu) TileGlu<R, V>(a, r, c);
    else Tile<R, V>(a, r, c);
  });
}

// The last n % kLanes columns, scalar (one panel: ld == n), rows [r0, r1).
void Ragged(const Args& a, int64_t c0, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < a.n; ++c) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < a.k; ++kk) acc += a.x[r * a.k + kk] * a.w[kk * a.ld + c];
      a.y[r * a.n + c] = a.residual == nullptr ? acc : a.residual[r * a.n + c] + acc;
    }
}

constexpr int64_t kWide = 4 * kLanes;  // the column tile of the main loop

// Column chunk `c` of `chunks`, rows [r0, r1): whole wide tiles, the last chunk taking the
// narrow remainder.
void Chunk(const Args& a, int64_t c, int64_t chunks, int64_t r0, int64_t r1) {
  const int64_t tiles = a.n / kWide;
  const int64_t begin = tiles * c / chunks * kWide, end = tiles * (c + 1) / chunks * kWide;
  Columns<4>(a, begin, end, r0, r1);
  if (c == chunks - 1) {
    const int64_t narrow_end = a.n / kLanes * kLanes;
    Columns<1>(a, end, narrow_end, r0, r1);
    Ragged(a, narrow_end, r0, r1);
  }
}

// Rows of x per block: a block's rows (k floats each) stay in the core's L2 while every column
// tile of the chunk streams past them. Without blocks each column tile read all of x again,
// from memory once x outgrew the L2 (a 4096-row step ran at about half XLA's GEMM speed).
constexpr int64_t kBlockBytes = 384 * 1024;

int64_t RowBlock(int64_t k) { return std::max<int64_t>(6, kBlockBytes / (4 * k) / 6 * 6); }

// The first `live` (clipped) of `rows`; zeros in y's rows after them.
int64_t LiveRows(const ffi::Buffer<ffi::S32>& live, int64_t rows, int64_t n, float* y) {
  const int64_t used = std::clamp<int64_t>(live.typed_data()[0], 0, rows);
  if (used < rows) std::memset(y + used * n, 0, static_cast<size_t>((rows - used) * n) * sizeof(float));
  return used;
}

// The product's work units, a row block (RowBlock) by a column chunk of its `tiles` wide column
// tiles, over threads once it is large enough: chunk(c, chunks, r0, r1) computes column chunk c
// of `chunks` for rows [r0, r1).
template <typename ChunkFn>
void RunBlocks(ffi::ThreadPool& pool, const Args& a, int64_t tiles, const ChunkFn& chunk) {
  // Threads pay off once a share is worth more than handing it over (a few microseconds).
  const int64_t flops = 2 * a.rows * a.k * a.n;
  const int64_t threads = std::min<int64_t>({static_cast<int64_t>(pool.num_threads()), tiles, flops / 400000});
  const int64_t chunks = threads > 1 ? std::min<int64_t>(tiles, threads * 2) : 1;
  const int64_t block = RowBlock(a.k), blocks = std::max<int64_t>(1, (a.rows + block - 1) / block);
  const int64_t rows = a.rows;
  cbjax_native::RunChunks(pool, threads, blocks * chunks, [chunk, chunks, block, rows](int64_t u) {
    const int64_t r0 = u / chunks * block;
    chunk(u % chunks, chunks, r0, std::min(rows, r0 + block));
  });
}

// ---- the RMS norm before a matmul: its rows are scale * (x * factor) ----
// The norm's per-row factor (rsqrt of the mean square plus eps) comes from XLA; the kernel applies
// it and the scale as XLA's multiply did, one f32 product then the other, into a scratch copy of
// x's live rows, so the product is the same bit for bit and no XLA op runs between the calls.

// Whether the norm operands are given (factor [rows] and scale [k]), absent (both empty), or wrong.
enum class NormArgs { kNone, kGiven, kBad };

NormArgs CheckNorm(const ffi::Buffer<ffi::F32>& factor, const ffi::Buffer<ffi::F32>& scale, int64_t rows, int64_t k) {
  if (factor.element_count() == 0 && scale.element_count() == 0) return NormArgs::kNone;
  return factor.element_count() == rows && scale.element_count() == k ? NormArgs::kGiven : NormArgs::kBad;
}

// x's first `rows` rows [rows, k] normed into this thread's scratch (kept between calls).
const float* NormedRows(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t k, const float* factor,
                        const float* scale) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < rows * k) scratch.resize(rows * k);
  float* out = scratch.data();
  const int64_t threads = std::min<int64_t>(pool.num_threads(), rows * k / 65536);
  const int64_t chunks = threads > 1 ? threads * 2 : 1;
  cbjax_native::RunChunks(pool, threads, chunks, [=](int64_t c) {
    for (int64_t r = rows * c / chunks; r < rows * (c + 1) / chunks; ++r) {
      const float f = factor[r];
      for (int64_t kk = 0; kk < k; ++kk) out[r * k + kk] = scale[kk] * (x[r * k + kk] * f);
    }
  });
  return out;
}

// The product x @ w[layer] (layer clipped to w's) over x's live rows: Args for a [k, n] matrix
// of w [layers, panels, k, P], y's rows `y_cols` wide, its rows past the live ones zeroed. With
// the norm operands given (factor [rows], scale [k]), x's live rows are normed first; operands of
// other sizes, unless both are empty, are an error naming `kernel`, returned before y is written.
ffi::ErrorOr<Args> LayerArgs(const char* kernel, ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                             const ffi::Buffer<ffi::F32>& w, const ffi::Buffer<ffi::S32>& layer,
                             const ffi::Buffer<ffi::S32>& live, const ffi::Buffer<ffi::F32>& factor,
                             const ffi::Buffer<ffi::F32>& scale, int64_t y_cols, float* y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const NormArgs norm = CheckNorm(factor, scale, xd[0], xd[1]);
  if (norm == NormArgs::kBad) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(kernel) + ": the norm's factor must be [rows] and scale [k], or both empty"));
  }
  const int64_t index = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const int64_t rows = LiveRows(live, xd[0], y_cols, y);
  const float* rows_x = norm == NormArgs::kGiven
                            ? NormedRows(pool, x.typed_data(), rows, xd[1], factor.typed_data(), scale.typed_data())
                            : x.typed_data();
  return Args{rows_x, w.typed_data() + index * wd[1] * wd[2] * wd[3], y, rows, xd[1], wd[1] * wd[3], wd[3]};
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> factor,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || xd[1] != wd[2]) {
    return ffi::Error::InvalidArgument("cbjax_layer_matmul: x must be [rows, k] and w [layers, panels, k, P]");
  }
  // Column tiles must not straddle panels: several panels need a width of whole wide tiles.
  if (wd[1] > 1 && wd[3] % kWide != 0) {
    return ffi::Error::InvalidArgument("cbjax_layer_matmul: a panel width must be a multiple of the column tile");
  }
  const int64_t n = wd[1] * wd[3];
  if (residual.element_count() != 0 && residual.element_count() != xd[0] * n) {
    return ffi::Error::InvalidArgument("cbjax_layer_matmul: residual must be [rows, n] or empty");
  }
  ffi::ErrorOr<Args> args = LayerArgs("cbjax_layer_matmul", pool, x, w, layer, live, factor, scale, n, y->typed_data());
  if (args.has_error()) return args.error();
  Args a = *args;
  if (residual.element_count() != 0) {
    a.residual = residual.typed_data();
    // the rows past the live ones: the residual plus the product's zeros
    std::copy(a.residual + a.rows * n, a.residual + xd[0] * n, a.y + a.rows * n);
  }
  RunBlocks(pool, a, a.n / kWide, [a](int64_t c, int64_t chunks, int64_t r0, int64_t r1) { Chunk(a, c, chunks, r0, r1); });
  return ffi::Error::Success();
}

// ---- the gate/up matmul with its SwiGLU: silu(x @ gate) * (x @ up) ----

ffi::Error LayerMatmulGluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> factor,
                              ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  // The gate's columns and the up's must lie in panels of their own, in whole wide tiles.
  if (xd.size() != 2 || wd.size() != 4 || xd[1] != wd[2] || wd[1] % 2 != 0 || (wd[1] / 2 * wd[3]) % kWide != 0) {
    return ffi::Error::InvalidArgument(
        "cbjax_layer_matmul_glu: x must be [rows, k] and w [layers, panels, k, P], the gate's panels then "
        "the up's, each half a multiple of the column tile wide");
  }
  const ffi::ErrorOr<Args> args =
      LayerArgs("cbjax_layer_matmul_glu", pool, x, w, layer, live, factor, scale, wd[1] * wd[3] / 2, y->typed_data());
  if (args.has_error()) return args.error();
  const Args a = *args;
  const int64_t tiles = a.n / 2 / kWide;
  RunBlocks(pool, a, tiles, [a, tiles](int64_t c, int64_t chunks, int64_t r0, int64_t r1) {
    Columns<4, true>(a, tiles * c / chunks * kWide, tiles * (c + 1) / chunks * kWide, r0, r1);
  });
  return ffi::Error::Success();
}

// ---- the q/k/v matmul with the rotary embedding of q and k ----

ffi::Error LayerMatmulRopeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::F32> cos,
                               ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> factor, ffi::Buffer<ffi::F32> scale,
                               int64_t period, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto cd = cos.dimensions();
  const auto sd = sin.dimensions();
  const int64_t D = cd.size() == 2 ? cd[1] : 0;
  const bool tables = cd.size() == 2 && sd.size() == 2 && cd[0] == xd[0] && sd[0] == cd[0] && sd[1] == D;
  // Whole wide tiles, each holding whole heads: a head's halves meet in one tile.
  if (xd.size() != 2 || wd.size() != 4 || xd[1] != wd[2] || (wd[1] * wd[3]) % kWide != 0 || (wd[1] > 1 && wd[3] % kWide != 0) ||
      !tables || D < 2 || D % 2 != 0 || kWide % D != 0 || period < 1) {
    return ffi::Error::InvalidArgument(
        "cbjax_layer_matmul_rope: x must be [rows, k], w [layers, panels, k, P] in whole column tiles, cos and sin "
        "[rows, head_dim] with head_dim even and dividing the column tile, period >= 1");
  }
  const ffi::ErrorOr<Args> args =
      LayerArgs("cbjax_layer_matmul_rope", pool, x, w, layer, live, factor, scale, wd[1] * wd[3], y->typed_data());
  if (args.has_error()) return args.error();
  const Args a = *args;
  const Rope ro{cos.typed_data(), sin.typed_data(), D, period};
  const int64_t tiles = a.n / kWide;
  RunBlocks(pool, a, tiles, [a, ro, tiles](int64_t c, int64_t chunks, int64_t r0, int64_t r1) {
    ForTiles<4>(tiles * c / chunks * kWide, tiles * (c + 1) / chunks * kWide, r0, r1,
                [&](auto rows, int64_t r, int64_t col) { TileRope<decltype(rows)::value, 4>(a, ro, r, col); });
  });
  return ffi::Error::Success();
}

// ---- x @ w^T: the tied LM head (the embedding table [n, k], contracted on its last axis) ----

// y[:, c0 : c0 + kLanes], every row: one vector accumulator per column, each lane summing its own
// residue of k in order; TreeSum folds the kLanes accumulators into the block's kLanes outputs
// (each a tree over its lanes), then the k % kLanes tail is added in order. The block's kLanes
// rows of w stay in the L1 or L2 cache while the rows of x pass. Summing each output's lanes one
// by one took as long as the multiply-adds (docs/cpu_kernels.md).
void BlockNT(const Args& a, int64_t c0) {
  const int64_t body = a.k / kLanes * kLanes;
  const float* w = a.w + c0 * a.k;
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * a.k;
    Vec acc[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) acc[j] = Vec{};
    for (int64_t kk = 0; kk < body; kk += kLanes) {
      const Vec xv = Load(x + kk);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) acc[cbjax_native::BitReverse(j)] += xv * Load(w + j * a.k + kk);
    }
    Vec sums = cbjax_native::TreeSum(acc);
    for (int64_t kk = body; kk < a.k; ++kk)
      for (int j = 0; j < kLanes; ++j) sums[j] += x[kk] * w[j * a.k + kk];
    Store(a.y + r * a.n + c0, sums);
  }
}

// y[r0 : r0 + R, c0 : c0 + C] (the columns past the last whole block): R x C vector accumulators
// over k, each lane summing its own residue of k in order; then each sums its lanes in order and
// adds the k % kLanes tail.
template <int R, int C>
inline void TileNT(const Args& a, int64_t r0, int64_t c0) {
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = Vec{};
  const int64_t body = a.k / kLanes * kLanes;
  for (int64_t kk = 0; kk < body; kk += kLanes) {
    Vec xv[R];
    for (int i = 0; i < R; ++i) xv[i] = Load(a.x + (r0 + i) * a.k + kk);
    for (int j = 0; j < C; ++j) {
      const Vec wv = Load(a.w + (c0 + j) * a.k + kk);
      for (int i = 0; i < R; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[i][j][l];
      for (int64_t kk = body; kk < a.k; ++kk) sum += a.x[(r0 + i) * a.k + kk] * a.w[(c0 + j) * a.k + kk];
      a.y[(r0 + i) * a.n + c0 + j] = sum;
    }
}

template <int C>
void RowsNT(const Args& a, int64_t c) {
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) TileNT<4, C>(a, r, c);
  switch (a.rows - r) {
    case 3: TileNT<3, C>(a, r, c); break;
    case 2: TileNT<2, C>(a, r, c); break;
    case 1: TileNT<1, C>(a, r, c); break;
    default: break;
  }
}

// Output columns [c0, c1), all rows.
void ColumnsNT(const Args& a, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 4 <= c1; c += 4) RowsNT<4>(a, c);
  for (; c < c1; ++c) RowsNT<1>(a, c);
}

ffi::Error MatmulNTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("cbjax_matmul_nt: x must be [rows, k] and w [n, k]");
  }
  const int64_t rows = LiveRows(live, xd[0], wd[0], y->typed_data());
  Args a{x.typed_data(), w.typed_data(), y->typed_data(), rows, xd[1], wd[0], xd[1]};
  const int64_t flops = 2 * a.rows * a.k * a.n;
  const int64_t blocks = a.n / kLanes;
  const int64_t threads =
      std::min<int64_t>({static_cast<int64_t>(pool.num_threads()), std::max<int64_t>(blocks, 1), flops / 400000});
  const int64_t chunks = threads > 1 ? std::min<int64_t>(blocks, threads * 8) : 1;
  cbjax_native::RunChunks(pool, threads, chunks, [a, chunks, blocks](int64_t c) {
    for (int64_t b = blocks * c / chunks; b < blocks * (c + 1) / chunks; ++b) BlockNT(a, b * kLanes);
    if (c == chunks - 1) ColumnsNT(a, blocks * kLanes, a.n);  // the last n % kLanes columns
  });
  return ffi::Error::Success();
}

}  // namespace

// The column tile's width in floats: whole heads of a head_dim dividing it take the rotary
// embedding in cbjax_layer_matmul_rope's epilogue (cbjax.kernels.native.rope_applies).
extern "C" int64_t cbjax_matmul_tile_columns() { return kWide; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxMatmulNT, MatmulNTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [rows, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [n, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [rows, n]

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [layers, panels, k, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm factor [rows] or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm scale [k] or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [rows, n] or empty
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxLayerMatmulRope, LayerMatmulRopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [layers, panels, k, P]: the fused q/k/v kernel
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [rows, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [rows, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm factor [rows] or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm scale [k] or empty
                                  .Attr<int64_t>("period")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [rows, n]

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxLayerMatmulGlu, LayerMatmulGluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [layers, panels, k, P]: gate, then up
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm factor [rows] or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm scale [k] or empty
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [rows, n / 2]
