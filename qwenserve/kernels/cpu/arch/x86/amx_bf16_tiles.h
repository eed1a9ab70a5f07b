// The 32-blocks' tile kernel on AMX, in bf16 (bf16 runs, from kAmxBf16MinRows activation rows): each weight block
// is decoded once per call to bf16 with its fp16 scale folded in, (code - offset) x d (+ m for Q4_1) rounded to
// nearest as ggml_dequantize rounds it, so one tile multiply (16 activation rows x 16 weight rows x 32 codes: one
// block) adds into float sums that run over the whole row, and the activations enter as they are, unquantized.
// The int8 tiles (amx_tiles.h) would need their sums out of the tiles after every block to apply its scale; that
// made them no faster than the VNNI sweeps. The result is the dense route's (the weights dequantized to bf16, a
// bf16 matmul summing in float) without the dequantized matrix in memory: docs/tuning.md, "The AMX bf16 kernel".
//
// A B tile holds a block of 16 weight rows as 16 pairs of codes: row p, dword n = weight row n's codes 2p and 2p+1
// (TileBlock16's quad q gives rows 2q and 2q+1). The A tiles load the activations from x itself (16 rows, 32 codes,
// stride K), the last group of fewer than 16 rows from a zero-padded copy.
#pragma once

#include "arch/x86/amx_tiles.h"

#if QS_X86_AMX_BUILD

#define QS_AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace qwenserve::cpu::ggml::x86 {

// Whether this process may run AMX bf16 tiles
inline bool amx_bf16_available() {
  static const bool available = cpu_has_amx(22) && amx_tile_state_granted();
  return available;
}

inline bool use_amx_bf16() { return amx_allowed().load(std::memory_order_relaxed) && amx_bf16_available(); }

// the kernel types it takes: the 32-blocks
template <typename Kernel>
constexpr bool kAmxBf16Tiles = Kernel::kBlock == 32 && kTiles<Kernel>;

constexpr int64_t kAmxBf16MinRows = 32;

struct alignas(64) Bf16Tile {  // one block of 16 weight rows: row p, dword n = row n's codes 2p, 2p + 1 in bf16
  __m512i pairs[16];
};

// Block b of 16 weight rows (rows 0-7 from one group of the decode layout at g0, 8-15 from the next at g1)
template <typename Kernel>
inline void decode_bf16_block16(const uint8_t* g0, const uint8_t* g1, Bf16Tile& t) {
  TileBlock16 q;
  decode_tile_block16<Kernel>(g0, g1, q);
  // (c - off) d (+ m) in one fma, exact in float: an 8-bit code times an fp16, one rounding to bf16 after
  __m512 shift = _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(-kTileOffset<Kernel>)), q.scale);
  if constexpr (Kernel::kHasMinTerm) shift = _mm512_add_ps(shift, q.min);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // cvtne2ps puts one vector's 16 bf16 after the other's; the pairs want them interleaved
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto value = [&](__m512i codes) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), q.scale, shift); };
  for (int k = 0; k < 8; ++k) {
    const __m512i v = q.codes[k];
    const __m512 c0 = value(_mm512_and_si512(v, byte)), c1 = value(_mm512_and_si512(_mm512_srli_epi32(v, 8), byte));
    const __m512 c2 = value(_mm512_and_si512(_mm512_srli_epi32(v, 16), byte)), c3 = value(_mm512_srli_epi32(v, 24));
    t.pairs[2 * k] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(c1, c0)));
    t.pairs[2 * k + 1] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(c3, c2)));
  }
}

// Tiles 0-3: C, float sums of (activation group i, weight group j) at 2i + j; 4, 5: A; 6, 7: B
template <int MA, int NB>
QS_AMX_BF16_TARGET void amx_bf16_rows(const Bf16Tile* const* b_tiles, const uint16_t* const* a_rows, int64_t lda,
                                      int64_t nb, float (*res)[16][16]) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MA == 2) _tile_zero(2);
  if constexpr (MA == 2 && NB == 2) _tile_zero(3);
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(4, a_rows[0] + 32 * b, 2 * lda);
    if constexpr (MA == 2) _tile_loadd(5, a_rows[1] + 32 * b, 2 * lda);
    _tile_loadd(6, b_tiles[0][b].pairs, 64);
    if constexpr (NB == 2) _tile_loadd(7, b_tiles[1][b].pairs, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MA == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, res[0], 64);
  if constexpr (NB == 2) _tile_stored(1, res[1], 64);
  if constexpr (MA == 2) _tile_stored(2, res[2], 64);
  if constexpr (MA == 2 && NB == 2) _tile_stored(3, res[3], 64);
}

// out[M, N] = x [M, K] (bf16) times the 32-block weights in the decode layout (N a multiple of 16), plus bias
template <typename Kernel, typename T>
void mm_amx_bf16(T* out, int64_t ldo, const T* x, int64_t M, int64_t K, const Layout& w, int64_t N,
                 const float* bias) {
  static_assert(sizeof(T) == 2, "the A tiles take bf16 activations");
  const int64_t nb = K / 32, groups = (M + 15) / 16, full = M / 16;
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  std::vector<uint16_t> tail;  // the last group's rows, zero-padded to 16
  if (full < groups) {
    tail.assign(static_cast<size_t>(16 * K), 0);
    std::memcpy(tail.data(), xs + full * 16 * K, static_cast<size_t>((M - 16 * full) * K) * 2);
  }
  auto group_rows = [&](int64_t g) { return g < full ? xs + g * 16 * K : tail.data(); };
  const TileConfig config = tile_config();
  const int64_t weight_groups = N / 16, weight_pairs = (weight_groups + 1) / 2;
  at::parallel_for(0, weight_pairs, 1, [&](int64_t p0, int64_t p1) {
    load_tile_config(config);
    std::vector<Bf16Tile> tiles(static_cast<size_t>(2 * nb));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t first = 2 * p, count = std::min<int64_t>(2, weight_groups - first);
      const Bf16Tile* b_tiles[2] = {tiles.data(), tiles.data() + nb};
      for (int64_t j = 0; j < count; ++j) {
        const uint8_t* g0 = w.row(16 * (first + j));
        const uint8_t* g1 = w.row(16 * (first + j) + 8);
        for (int64_t b = 0; b < nb; ++b)
          decode_bf16_block16<Kernel>(g0 + b * 8 * Kernel::kBytes, g1 + b * 8 * Kernel::kBytes, tiles[j * nb + b]);
      }
      for (int64_t m = 0; m < groups; m += 2) {
        const uint16_t* a_rows[2] = {group_rows(m), m + 1 < groups ? group_rows(m + 1) : nullptr};
        alignas(64) float res[4][16][16];
        if (m + 1 < groups) {
          if (count == 2) amx_bf16_rows<2, 2>(b_tiles, a_rows, K, nb, res);
          else amx_bf16_rows<2, 1>(b_tiles, a_rows, K, nb, res);
        } else {
          if (count == 2) amx_bf16_rows<1, 2>(b_tiles, a_rows, K, nb, res);
          else amx_bf16_rows<1, 1>(b_tiles, a_rows, K, nb, res);
        }
        for (int i = 0; i < 2 && m + i < groups; ++i)
          for (int64_t j = 0; j < count; ++j)
            store_rows<16>(out, ldo, 1, 16 * (m + i), static_cast<int>(std::min<int64_t>(16, M - 16 * (m + i))),
                           16 * (first + j), res[2 * i + j][0], bias);
      }
    }
    release_tiles();
  });
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AMX_BUILD
