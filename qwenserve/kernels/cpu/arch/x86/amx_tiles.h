// The K-quant tile kernel on AMX (Sapphire Rapids and later Xeons): from kAmxMinRows activation rows, one tile
// multiply takes 16 activation rows against 16 weight rows over 64 codes, where the AVX512-VNNI sweep
// (vnni_tiles.h) needs 16 vpdpbusd per activation row. A tile multiply sums over all its 64 codes, but a K-quant's
// scale changes every 32 (Q6_K: 16) codes; so each decoded code is multiplied by its sub-block's scale first, and
// the product (at most 4096 in magnitude: an int16) split into a low byte (unsigned) and a high one (signed), two B
// tiles whose products with the same A tile sum to the super-block's integer sum as 256 hi + lo. That is the one
// integer sum every kernel forms, and it leaves the tiles once per super-block (256 codes) rather than once per
// sub-block, which the vector units could not keep up with. The 32-blocks (fp16 scale per 32 codes) go to bf16
// tiles instead (amx_bf16_tiles.h): scaling each block's int8 tile in vectors made them no faster than the VNNI
// sweep.
//
// The codes come from decode_tile_block16 (row q of a B tile: quad q of 16 weight rows, as TileSuperBlock16 holds
// them), the activation rows are packed into A tiles of 16 rows x 64 codes. Built into the variants whose CPUs may
// have AMX (AVX512-BF16: every AMX CPU has it) with the AMX instructions enabled per function, and run only where
// CPUID reports AMX-TILE and AMX-INT8 and Linux grants the process the tile state.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "arch/x86/vnni_tiles.h"
#include "cpu_features.h"
#include "ggml/common.h"

#if QS_X86_AMX_BUILD
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QS_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))

namespace qwenserve::cpu::ggml::x86 {

// Whether the CPU has AMX-TILE (CPUID 7.0 EDX bit 24) and the tile multiplies of EDX bit `feature` (25: INT8,
// 22: BF16)
inline bool cpu_has_amx(int feature) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1) && ((d >> feature) & 1);
}

// Whether Linux, which hands out the 8 KiB tile state per process on request, granted it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA)
inline bool amx_tile_state_granted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether this process may run AMX int8 tiles
inline bool amx_int8_available() {
  static const bool available = cpu_has_amx(25) && amx_tile_state_granted();
  return available;
}

// Whether ggml_mm may take the AMX kernel where it is available (ggml_allow_amx sets it: tests and benchmarks run the
// VNNI sweep on the same CPU for comparison)
inline std::atomic<bool>& amx_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

inline bool use_amx() { return amx_allowed().load(std::memory_order_relaxed) && amx_int8_available(); }

// from this many activation rows (a pair of A tiles) the AMX kernel runs; below, the VNNI sweeps, which at 16 rows
// were as fast or faster (docs/tuning.md, "Tiles")
constexpr int64_t kAmxMinRows = 32;

// Tiles 0-3: C, 16 activation rows x 16 weight rows of int32: A 0's products with the low bytes (0) and the high
// ones (1), A 1's (2, 3); 4 and 5: A, 16 activation rows x 64 codes; 6 and 7: B, the low and the high bytes of 64
// codes (16 quads) x 16 weight rows. Tiles are not renamed: a tile multiply into a C whose results are still being
// stored waits, so the next super-block's multiplies are issued once this one's are stored, and run while the
// vector units finish this one.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}

// A K-quant super-block of 16 weight rows for the tiles: the VNNI sweep's decoding (its pairs, d and dmin serve
// finish_superblock16 as they are), with codes[q] holding the low bytes of each code times its scale, hi[q] the high
// bytes
struct AmxSuperBlock16 {
  TileSuperBlock16 t;
  __m512i hi[64];
};

template <typename Kernel>
inline void decode_amx_block16(const uint8_t* g0, const uint8_t* g1, AmxSuperBlock16& s) {
  constexpr bool kQ6 = std::is_same_v<Kernel, Q6_KKernel>;
  decode_tile_block16<Kernel>(g0, g1, s.t);
  constexpr int kQuadsPerScale = kQ6 ? 4 : 8;  // sub-blocks of 16 or 32 codes
  const __m512i low_byte = _mm512_set1_epi16(0x00FF);
  // Q6_K's codes less their offset 32 (|sc (q - 32)| <= 128 x 32), so that the tiles' sums need no correction
  const __m512i offset = _mm512_set1_epi16(kQ6 ? 32 : 0);
  for (int q = 0; q < 64; ++q) {
    const __m512i sc = s.t.scales[q / kQuadsPerScale];  // lane r: row r's scale, into both of its int16s
    const __m512i sc16 = _mm512_or_si512(_mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc, 16));
    const __m512i v = s.t.codes[q];
    // codes 0 and 2 of each quad, then 1 and 3
    const __m512i even = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(v, low_byte), offset), sc16);
    const __m512i odd = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(v, 8), offset), sc16);
    s.t.codes[q] = _mm512_or_si512(_mm512_and_si512(even, low_byte), _mm512_slli_epi16(odd, 8));
    s.hi[q] = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 8), low_byte),
                              _mm512_andnot_si512(low_byte, odd));
  }
}

// The tile instructions name their tiles in the instruction itself: A group I's tiles by template argument
template <int I>
inline void load_activations(const int8_t* a) {
  if constexpr (I == 0) _tile_loadd(4, a, 64); else _tile_loadd(5, a, 64);
}
template <int I>
inline void multiply() {
  if constexpr (I == 0) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
  } else {
    _tile_dpbsud(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
}
template <int I>
inline void zero_products() {
  if constexpr (I == 0) { _tile_zero(0); _tile_zero(1); } else { _tile_zero(2); _tile_zero(3); }
}
template <int I>
inline void store_products(int32_t (*lo)[16], int32_t (*hi)[16]) {
  if constexpr (I == 0) {
    _tile_stored(0, lo, 64);
    _tile_stored(1, hi, 64);
  } else {
    _tile_stored(2, lo, 64);
    _tile_stored(3, hi, 64);
  }
}

// MA groups of 16 activation rows (codes[i]: group i's packed A tiles, 64 codes of each row, one tile after
// another; act[i]: its rows' blocks, row r's block b at act[i][r * nb + b]) against `count` decoded super-blocks of
// one group of 16 weight rows, added to res[i][r][w] (activation row r of group i, weight row w)
template <typename Kernel, int MA>
QS_AMX_TARGET void amx_rows(const AmxSuperBlock16* tile, const int8_t* const* codes, const ActQ8_K* const* act,
                            int64_t nb, int64_t count, float (*res)[16][16]) {
  auto issue = [&](int64_t b) {  // super-block b's tile multiplies
    zero_products<0>();
    if constexpr (MA == 2) zero_products<1>();
    for (int k = 0; k < 4; ++k) {
      load_activations<0>(codes[0] + (4 * b + k) * 1024);
      if constexpr (MA == 2) load_activations<1>(codes[1] + (4 * b + k) * 1024);
      _tile_loadd(6, tile[b].t.codes + 16 * k, 64);
      _tile_loadd(7, tile[b].hi + 16 * k, 64);
      multiply<0>();
      if constexpr (MA == 2) multiply<1>();
    }
  };
  alignas(64) int32_t lo[MA][16][16], hi[MA][16][16];
  issue(0);
  for (int64_t b = 0; b < count; ++b) {
    store_products<0>(lo[0], hi[0]);
    if constexpr (MA == 2) store_products<1>(lo[MA - 1], hi[MA - 1]);
    if (b + 1 < count) issue(b + 1);
    for (int i = 0; i < MA; ++i)
      for (int r = 0; r < 16; ++r) {
        const __m512i isum =
            _mm512_add_epi32(_mm512_load_si512(lo[i][r]), _mm512_slli_epi32(_mm512_load_si512(hi[i][r]), 8));
        const ActQ8_K& a = act[i][r * nb + b];
        __m512 v;
        if constexpr (std::is_same_v<Kernel, Q6_KKernel>)  // its offset is in the codes: d dy isum
          v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(tile[b].t.d, _mm512_set1_ps(a.d)));
        else
          v = finish_superblock16<Kernel>(tile[b].t, a, isum);
        _mm512_storeu_ps(res[i][r], _mm512_add_ps(_mm512_loadu_ps(res[i][r]), v));
      }
  }
}

QS_AMX_TARGET inline void load_tile_config(const TileConfig& config) { _tile_loadconfig(&config); }
QS_AMX_TARGET inline void release_tiles() { _tile_release(); }

// The activation rows' codes as the A tiles load them: group g of 16 rows, codes 64c .. 64c + 63 of its 16 rows at
// ((g * K / 64) + c) * 1024
inline std::vector<int8_t> pack_activation_codes(const ActQ8_K* act, int64_t groups, int64_t nb) {
  std::vector<int8_t> packed(static_cast<size_t>(groups * 16 * nb * 256));
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < 4 * nb; ++c)
        for (int r = 0; r < 16; ++r)
          std::memcpy(packed.data() + ((g * 4 * nb + c) * 16 + r) * 64,
                      act[(16 * g + r) * nb + c / 4].qs + (c % 4) * 64, 64);
  });
  return packed;
}

// the kernel types the AMX kernel takes
template <typename Kernel>
constexpr bool kAmxTiles = Kernel::kBlock == 256 && kTiles<Kernel>;

// Cache blocking: a thread decodes a few groups of 16 weight rows, and takes their super-blocks kAmxSpan at a time,
// each span swept by every pair of activation groups, so the decoded span (up to kAmxSpanBytes) stays in L2 while
// the activations' codes stream past it, once per few weight groups rather than once per group. Without the span,
// the 7B shape's down_proj (18944 codes a row) at 512 rows ran slower than the VNNI sweep.
constexpr int64_t kAmxSpan = 16;
constexpr int64_t kAmxSpanBytes = 1 << 20;

// out[M / levels, N] from K-quant weights in the decode layout (N a multiple of 16), act holding M rows rounded up
// to a multiple of 16 (the A tiles take whole groups of 16; the rows past M are never stored)
template <typename Kernel, typename T>
void mm_amx(T* out, int64_t ldo, int64_t levels, const ActQ8_K* act, int64_t M, int64_t nb, const Layout& w,
            int64_t N, const float* bias) {
  const int64_t groups = (M + 15) / 16, group_bytes = 16 * nb * 256;
  const std::vector<int8_t> codes = pack_activation_codes(act, groups, nb);
  const TileConfig config = tile_config();
  const int64_t span = std::min(kAmxSpan, nb);
  const int64_t per_pass =
      std::max<int64_t>(1, kAmxSpanBytes / (span * static_cast<int64_t>(sizeof(AmxSuperBlock16))));
  const int64_t weight_groups = N / 16, passes = (weight_groups + per_pass - 1) / per_pass;
  at::parallel_for(0, passes, 1, [&](int64_t p0, int64_t p1) {
    load_tile_config(config);  // each thread's tiles are its own
    std::vector<AmxSuperBlock16> tile(static_cast<size_t>(per_pass * nb));
    std::vector<float> sums(static_cast<size_t>(per_pass * groups * 256));  // [weight group][activation row][16]
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t first_group = p * per_pass, count = std::min(per_pass, weight_groups - first_group);
      for (int64_t j = 0; j < count; ++j) {
        const uint8_t* first = w.row(16 * (first_group + j));
        const uint8_t* second = w.row(16 * (first_group + j) + 8);
        for (int64_t b = 0; b < nb; ++b)
          decode_amx_block16<Kernel>(first + b * 8 * Kernel::kBytes, second + b * 8 * Kernel::kBytes,
                                     tile[j * nb + b]);
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t b0 = 0; b0 < nb; b0 += span) {
        const int64_t blocks = std::min(span, nb - b0);
        for (int64_t m = 0; m < groups; m += 2) {
          const int8_t* a_codes[2] = {codes.data() + m * group_bytes + b0 * 4096,
                                      codes.data() + (m + 1) * group_bytes + b0 * 4096};
          const ActQ8_K* a_rows[2] = {act + 16 * m * nb + b0, act + 16 * (m + 1) * nb + b0};
          for (int64_t j = 0; j < count; ++j) {
            auto* res = reinterpret_cast<float(*)[16][16]>(sums.data() + (j * groups + m) * 256);
            if (m + 1 < groups)
              amx_rows<Kernel, 2>(tile.data() + j * nb + b0, a_codes, a_rows, nb, blocks, res);
            else
              amx_rows<Kernel, 1>(tile.data() + j * nb + b0, a_codes, a_rows, nb, blocks, res);
          }
        }
      }
      for (int64_t j = 0; j < count; ++j)
        for (int64_t m = 0; m < groups; ++m)
          store_rows<16>(out, ldo, levels, 16 * m, static_cast<int>(std::min<int64_t>(16, M - 16 * m)),
                         16 * (first_group + j), sums.data() + (j * groups + m) * 256, bias);
    }
    release_tiles();
  });
}

}  // namespace qwenserve::cpu::ggml::x86

#endif  // QS_X86_AMX_BUILD
