// The x86 tile kernels' driver, shared by the 256-bit tiles (avx2_tiles.h) and the AVX512-VNNI ones
// (vnni_tiles.h): which weight rows each thread decodes, when a tile is decoded against when it is swept, and the
// read-ahead of the weights. The kernel files bring the tile layout, its decoder and its sweep.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AVX2

namespace qwenserve::cpu::ggml::x86 {

// bytes at p into L2
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// f(std::integral_constant<int, r>) for r = 1..R: the sweeps keep a compile-time count of accumulators
template <int R, typename F>
inline void with_rows(int r, F f) {
  if constexpr (R >= 1) {
    if (r == R) return f(std::integral_constant<int, R>{});
    with_rows<R - 1>(r, f);
  }
}

// out[M, N] from weights in the decode layout, Width weight rows (Width / 8 groups of the layout, side by side in
// memory) at a time, the groups of Width rows split among the threads. Up to Rows activation rows take one sweep,
// each block decoded as it is swept into a tile that stays in L1; more rows decode all of the Width rows' blocks
// once (a few KiB a block) and sweep them Rows rows at a time. Either way block b of the next Width rows is asked
// into L2 as block b of these is decoded: a decode step streams the weights from memory, and a thread otherwise
// waits for each group before it computes, and computes before it asks for the next.
//   decode(rows, at, tile): the block at byte `at` of each group of the Width rows that start at `rows`
//   sweep(count, tile_of, m0, res): res[i][k] = activation row m0 + i . weight row k for i < count (an
//     std::integral_constant), tile_of(b) giving block b's tile
template <typename Tile, int Width, int Rows, int64_t BlockBytes, typename T, typename Decode, typename Sweep>
void sweep_tiles(T* out, int64_t ldo, int64_t levels, int64_t M, int64_t nb, const Layout& w, int64_t N,
                 const float* bias, Decode decode, Sweep sweep) {
  static_assert(Width % 8 == 0);
  at::parallel_for(0, N / Width, 1, [&](int64_t g0, int64_t g1) {
    std::vector<Tile> tile(M <= Rows ? 1 : static_cast<size_t>(nb));
    float res[Rows][Width];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rows = w.row(Width * g);
      const bool more = g + 1 < g1;
      auto decoded = [&](int64_t b, Tile& t) -> const Tile& {
        const int64_t at = b * 8 * BlockBytes;
        if (more)
          for (int h = 0; h < Width / 8; ++h) prefetch_block(rows + (Width + 8 * h) * w.ld + at, 8 * BlockBytes);
        decode(rows, at, t);
        return t;
      };
      if (M <= Rows) {
        auto tile_of = [&](int64_t b) -> const Tile& { return decoded(b, tile[0]); };
        with_rows<Rows>(static_cast<int>(M), [&](auto count) { sweep(count, tile_of, int64_t{0}, res); });
        store_rows<Width>(out, ldo, levels, 0, static_cast<int>(M), Width * g, res[0], bias);
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) decoded(b, tile[b]);
      auto tile_of = [&](int64_t b) -> const Tile& { return tile[b]; };
      for (int64_t m0 = 0; m0 < M; m0 += Rows) {
        const int r = static_cast<int>(std::min<int64_t>(Rows, M - m0));
        with_rows<Rows>(r, [&](auto count) { sweep(count, tile_of, m0, res); });
        store_rows<Width>(out, ldo, levels, m0, r, Width * g, res[0], bias);
      }
    }
  });
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AVX2
