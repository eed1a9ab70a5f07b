// The ARM ggml kernels (qwenserve/kernels/cpu/arch/arm/) against the scalar reference (ggml/quants_ref.cpp), built
// without PyTorch (stub/ATen/ATen.h stands in) for whichever aarch64 feature set the compiler flags give, and run
// on an aarch64 CPU or under qemu-user (tests/test_arm_kernels.py). Exits 0 when every kernel agrees, else 1 with
// a line naming the kernel, the type and the rows of each disagreement.
//
// Two kinds of weights and activations per case:
//   exact   scales that are powers of two and codes small enough that every product and every partial sum, in
//           any order, is exact in float32: kernel and reference must agree bit for bit, which checks each
//           block's integer dot product exactly;
//   random  random fp16 scales and codes over their whole range: the integers are the same, only the float
//           summation order (and fma against a product then a sum) differs, so the results may differ by the
//           rounding of that summation: |got - ref| <= (4 nb + 8) 2^-24 S, S the sum over the row of
//           (|w| + 2 |min|) |a| (a bound on the sum of the magnitudes of the terms both sides add: the rounding
//           bound of a sum of 2 nb products on each side). One unit of a block's integer sum moves the result by
//           |d a.d|, well above that tolerance at these sizes, so a wrong integer still fails.
// Dequantizing and the activation quantizers must agree bit for bit, and fp16_at, which both sides read the
// scales with, must read every fp16 code as the format defines it.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "arch/arm/dotprod.h"
#include "arch/arm/neon.h"
#include "cpu_features.h"
#include "ggml/common.h"
#include "ggml/quants_ref.h"
#if QS_ARM_I8MM
#include "arch/arm/i8mm.h"
#endif

#if !QS_ARM_NEON
#error "kernel_check.cpp tests the aarch64 NEON kernels: build it for aarch64"
#endif

namespace {

using namespace qwenserve::cpu::ggml;

int failures = 0;

void fail(const std::string& what) {
  if (failures < 40) std::fprintf(stderr, "MISMATCH %s\n", what.c_str());
  ++failures;
}

std::mt19937_64 rng(20240601);

int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

uint16_t fp16_bits(float v) {
  const __fp16 h = static_cast<__fp16>(v);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
void put_fp16(uint8_t* p, float v) {
  const uint16_t bits = fp16_bits(v);
  p[0] = static_cast<uint8_t>(bits & 0xFF);
  p[1] = static_cast<uint8_t>(bits >> 8);
}

// a random normal fp16 scale of either sign, magnitude 2^-10 .. 2^-2
float random_scale() {
  const float mag = std::ldexp(1.0f + std::uniform_real_distribution<float>(0.0f, 1.0f)(rng), uniform(-10, -3));
  return uniform(0, 1) ? mag : -mag;
}

const char* type_name(int64_t type) {
  switch (type) {
    case kQ4_0: return "Q4_0";
    case kQ4_1: return "Q4_1";
    case kQ5_0: return "Q5_0";
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ5_K: return "Q5_K";
    case kQ6_K: return "Q6_K";
    default: return "?";
  }
}

// Q4_K / Q5_K's 12 packed bytes from 8 six-bit scales and mins (the inverse of get_scale_min_k4)
void pack_scales_mins(const int* sc, const int* mn, uint8_t* out) {
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    out[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

// One weight block of the type: random code bytes, then the scales. exact: d = +-2^-4, dmin = +-2^-4, sub-block
// scales at most 7 (Q6_K: -4..4), mins at most 63.
void make_block(int64_t type, bool exact, uint8_t* b) {
  const BlockInfo bi = block_info(type);
  for (int64_t i = 0; i < bi.bytes; ++i) b[i] = static_cast<uint8_t>(uniform(0, 255));
  auto scale = [&] { return exact ? (uniform(0, 1) ? 0.0625f : -0.0625f) : random_scale(); };
  switch (type) {
    case kQ4_0: case kQ5_0: case kQ8_0: put_fp16(b, scale()); break;
    case kQ4_1: put_fp16(b, scale()); put_fp16(b + 2, scale()); break;
    case kQ4_K:
    case kQ5_K: {
      put_fp16(b, scale());
      put_fp16(b + 2, scale());
      int sc[8], mn[8];
      for (int j = 0; j < 8; ++j) {
        sc[j] = exact ? uniform(0, 7) : uniform(0, 63);
        mn[j] = uniform(0, 63);
      }
      pack_scales_mins(sc, mn, b + 4);
      break;
    }
    case kQ6_K: {
      for (int j = 0; j < 16; ++j) b[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(exact ? uniform(-4, 4)
                                                                                              : uniform(-128, 127)));
      put_fp16(b + 208, scale());
      break;
    }
    default: break;
  }
}

// Activation blocks with their sums. exact: d = 2^-7 and codes -15..15; random: a random float d, codes over the
// whole int8 range the quantizers give (-127..127).
void make_act(bool exact, ActQ8_0& a) {
  for (int j = 0; j < 32; ++j) a.qs[j] = static_cast<int8_t>(exact ? uniform(-15, 15) : uniform(-127, 127));
  a.d = exact ? 0.0078125f : static_cast<float>(static_cast<__fp16>(random_scale()));
  a.sum = a.quad_sums[0] = a.quad_sums[1] = 0;
  for (int j = 0; j < 32; ++j) {
    a.sum += a.qs[j];
    a.quad_sums[(j / 4) % 2] += a.qs[j];
  }
}
void make_act(bool exact, ActQ8_K& a) {
  for (int j = 0; j < 256; ++j) a.qs[j] = static_cast<int8_t>(exact ? uniform(-15, 15) : uniform(-127, 127));
  a.d = exact ? 0.0078125f : random_scale();
  for (int j = 0; j < 16; ++j) {
    int s = 0;
    for (int l = 0; l < 16; ++l) s += a.qs[16 * j + l];
    a.bsums[j] = static_cast<int16_t>(s);
  }
  for (int j = 0; j < 8; ++j) a.bsums32[j] = static_cast<int16_t>(a.bsums[2 * j] + a.bsums[2 * j + 1]);
}

// The weights of one case: n rows of nb blocks in the file's layout and the same blocks in the decode layout
template <typename Kernel>
struct Case {
  using Act = typename Kernel::Act;
  static constexpr int64_t kBytes = Kernel::kBytes;
  bool exact;
  int64_t n, nb;
  std::vector<uint8_t> file, decode;   // [n][nb] blocks; groups of 8 rows, block b of each side by side
  std::vector<Act> act;                // [rows][nb]
  std::vector<double> magnitude;       // [row][act row]: the S of the tolerance

  Case(bool exact_, int64_t n_, int64_t nb_, int64_t rows) : exact(exact_), n(n_), nb(nb_) {
    file.resize(static_cast<size_t>(n * nb * kBytes));
    decode.resize(file.size());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = file.data() + (r * nb + b) * kBytes;
        make_block(Kernel::kType, exact, blk);
        std::memcpy(decode.data() + ((r / 8) * 8 * nb + b * 8 + r % 8) * kBytes, blk, kBytes);
      }
    act.resize(static_cast<size_t>(rows * nb));
    for (Act& a : act) make_act(exact, a);
    magnitude.assign(static_cast<size_t>(n * rows), 0.0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float w[256], mins[256];
        const uint8_t* blk = file.data() + (r * nb + b) * kBytes;
        ref::dequantize_block(Kernel::kType, blk, w);
        // the blocks' min offsets (Q4_1's m, the K-quants' dmin m[s]): the block with its codes zeroed
        std::fill(mins, mins + 256, 0.0f);
        if constexpr (Kernel::kHasMinTerm) {
          uint8_t zeroed[256];
          std::memcpy(zeroed, blk, kBytes);
          const int64_t codes_at = Kernel::kBlock == 32 ? 4 : 16;
          std::memset(zeroed + codes_at, 0, static_cast<size_t>(kBytes - codes_at));
          ref::dequantize_block(Kernel::kType, zeroed, mins);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const Act& a = act[i * nb + b];
          for (int64_t k = 0; k < Kernel::kBlock; ++k)
            magnitude[r * rows + i] += (std::fabs(w[k]) + 2.0 * std::fabs(mins[k])) * std::fabs(a.d * a.qs[k]);
        }
      }
  }
  int64_t rows() const { return static_cast<int64_t>(act.size()) / nb; }

  void check(const char* kernel, int64_t row, int64_t act_row, int r, float got, float want) const {
    const double tol = exact ? 0.0 : (4.0 * nb + 8.0) * std::ldexp(1.0, -24) * magnitude[row * rows() + act_row];
    if (!(std::fabs(static_cast<double>(got) - want) <= tol)) {
      char line[400];
      std::snprintf(line, sizeof(line), "%s %s (%s, %lld blocks) activation rows %d: weight row %lld x activation "
                    "row %lld: kernel %.9g, reference %.9g, tolerance %.3g", kernel, type_name(Kernel::kType),
                    exact ? "exact" : "random", static_cast<long long>(nb), r, static_cast<long long>(row),
                    static_cast<long long>(act_row), got, want, tol);
      fail(line);
    }
  }

  // the reference: weight row `row` against activation rows m0 .. m0 + R - 1
  template <int R>
  void reference(int64_t row, int64_t m0, float* res) const {
    const Act* y[4];
    for (int i = 0; i < R; ++i) y[i] = act.data() + (m0 + i) * nb;
    ref::dot_rows<Kernel, R>(file.data() + row * nb * kBytes, kBytes, nb, y, res);
  }
};

template <typename Kernel, int R>
void check_dot_rows(const Case<Kernel>& c) {
  using Act = typename Kernel::Act;
  const Act* y[4];
  for (int i = 0; i < R; ++i) y[i] = c.act.data() + i * c.nb;
  for (int64_t row = 0; row < c.n; ++row) {
    float want[R], got_file[R], got_decode[R];
    c.template reference<R>(row, 0, want);
    qwenserve::cpu::ggml::arm::dot_rows<Kernel, R>(c.file.data() + row * c.nb * Kernel::kBytes, Kernel::kBytes,
                                                   c.nb, y, got_file);
    const Layout decode{c.decode.data(), c.nb * Kernel::kBytes, kDecodeGroup, Kernel::kBytes};
    qwenserve::cpu::ggml::arm::dot_rows<Kernel, R>(decode.row(row), decode.block_stride(), c.nb, y, got_decode);
    for (int i = 0; i < R; ++i) {
      c.check("dot_rows (file layout)", row, i, R, got_file[i], want[i]);
      c.check("dot_rows (decode layout)", row, i, R, got_decode[i], want[i]);
    }
  }
}

template <typename Kernel, int R>
void check_dot8(const Case<Kernel>& c) {
  using Act = typename Kernel::Act;
  const Act* y[4];
  for (int i = 0; i < R; ++i) y[i] = c.act.data() + i * c.nb;
  const Layout decode{c.decode.data(), c.nb * Kernel::kBytes, kDecodeGroup, Kernel::kBytes};
  for (int64_t g = 0; g < c.n / 8; ++g) {
    float got[4][8];
    qwenserve::cpu::ggml::arm::dot8<Kernel, R>(decode.row(8 * g), c.nb, y, got);
    for (int k = 0; k < 8; ++k) {
      float want[R];
      c.template reference<R>(8 * g + k, 0, want);
      for (int i = 0; i < R; ++i) c.check("dot8 (decode layout)", 8 * g + k, i, R, got[i][k], want[i]);
    }
  }
}

#if QS_ARM_I8MM
// mm_tiles over m activation rows (its decode of each group and its sweep of the rows, two at a time)
template <typename Kernel>
void check_tiles(const Case<Kernel>& c, int64_t m) {
  const Layout decode{c.decode.data(), c.nb * Kernel::kBytes, kDecodeGroup, Kernel::kBytes};
  std::vector<float> out(static_cast<size_t>(m * c.n));
  qwenserve::cpu::ggml::arm::mm_tiles<Kernel, float>(out.data(), c.n, 1, c.act.data(), m, c.nb, decode, c.n,
                                                     nullptr);
  for (int64_t row = 0; row < c.n; ++row)
    for (int64_t i = 0; i < m; ++i) {
      float want[1];
      c.template reference<1>(row, i, want);
      c.check("mm_tiles (i8mm)", row, i, static_cast<int>(m), out[static_cast<size_t>(i * c.n + row)], want[0]);
    }
}
#endif

template <typename Kernel>
void check_type() {
  const int64_t nb_exact = Kernel::kBlock == 32 ? 8 : 4, nb_random = Kernel::kBlock == 32 ? 8 : 2;
  for (bool exact : {true, false}) {
    const Case<Kernel> c(exact, 16, exact ? nb_exact : nb_random, 33);
    check_dot_rows<Kernel, 1>(c);
    check_dot_rows<Kernel, 2>(c);
    check_dot_rows<Kernel, 3>(c);
    check_dot_rows<Kernel, 4>(c);
    check_dot8<Kernel, 1>(c);
    check_dot8<Kernel, 2>(c);
    check_dot8<Kernel, 3>(c);
    check_dot8<Kernel, 4>(c);
#if QS_ARM_I8MM
    for (int64_t m = 1; m <= 33; ++m) check_tiles<Kernel>(c, m);
#endif
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantizing and the quantizers: bit for bit

template <typename T>
uint32_t bits_of(T v) {
  uint32_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}

template <typename T>
void check_dequantize(int64_t type, const char* dtype) {
  const BlockInfo bi = block_info(type);
  std::vector<uint8_t> blk(static_cast<size_t>(bi.bytes));
  for (int n = 0; n < 64; ++n) {
    make_block(type, n % 2 == 0, blk.data());
    float want[256];
    T got[256];
    ref::dequantize_block(type, blk.data(), want);
    qwenserve::cpu::ggml::arm::dequantize_block(type, blk.data(), got);
    for (int64_t j = 0; j < bi.elems; ++j) {
      const T w = qwenserve::cpu::from_float<T>(want[j]);
      if (bits_of(got[j]) != bits_of(w)) {
        char line[200];
        std::snprintf(line, sizeof(line), "dequantize_block %s to %s: value %lld: kernel %.9g, reference %.9g",
                      type_name(type), dtype, static_cast<long long>(j), static_cast<float>(got[j]),
                      static_cast<float>(w));
        fail(line);
        break;
      }
    }
  }
}

// random activations (normal, a random magnitude per block), with blocks that test the edges: zeros, a
// largest magnitude met twice with both signs, values on rounding ties, infinitesimal ones
template <typename T>
std::vector<T> activations(int64_t n) {
  std::vector<T> x(static_cast<size_t>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float scale = std::ldexp(1.0f, uniform(-12, 6));
    for (int64_t j = 0; j < 32; ++j) {
      float v = normal(rng) * scale;
      switch (b % 8) {
        case 1: v = 0.0f; break;
        case 2: v = j == 3 ? -4.0f : j == 20 ? 4.0f : v; break;
        case 3: v = static_cast<float>(uniform(-254, 254)) * 0.5f; break;  // halves: ties at d = 1
        case 4: v = j == 0 ? 127.0f : static_cast<float>(uniform(-254, 254)) * 0.5f; break;
        case 5: v *= 1e-30f; break;
        default: break;
      }
      x[static_cast<size_t>(b * 32 + j)] = static_cast<T>(v);
    }
  }
  return x;
}

template <typename T>
void check_quantizers(const char* dtype) {
  const int64_t nb = 64;  // 2048 values: 64 q8_0 blocks, 8 q8_K blocks
  const std::vector<T> x = activations<T>(32 * nb);
  std::vector<ActQ8_0> want0(static_cast<size_t>(nb)), got0(static_cast<size_t>(nb));
  ref::quantize_row_q8_0(x.data(), nb, want0.data());
  qwenserve::cpu::ggml::arm::quantize_row_q8_0(x.data(), nb, got0.data());
  for (int64_t b = 0; b < nb; ++b) {
    const ActQ8_0 &g = got0[b], &w = want0[b];
    if (bits_of(g.d) != bits_of(w.d) || g.sum != w.sum || g.quad_sums[0] != w.quad_sums[0] ||
        g.quad_sums[1] != w.quad_sums[1] || std::memcmp(g.qs, w.qs, 32) != 0) {
      char line[200];
      std::snprintf(line, sizeof(line), "quantize_row_q8_0 from %s: block %lld (d %.9g / %.9g, sum %d / %d)", dtype,
                    static_cast<long long>(b), g.d, w.d, g.sum, w.sum);
      fail(line);
    }
  }
  std::vector<ActQ8_K> wantk(static_cast<size_t>(nb / 8)), gotk(static_cast<size_t>(nb / 8));
  ref::quantize_row_q8_K(x.data(), nb / 8, wantk.data());
  qwenserve::cpu::ggml::arm::quantize_row_q8_K(x.data(), nb / 8, gotk.data());
  for (int64_t b = 0; b < nb / 8; ++b)
    if (std::memcmp(&gotk[b], &wantk[b], sizeof(ActQ8_K)) != 0) {
      char line[200];
      std::snprintf(line, sizeof(line), "quantize_row_q8_K from %s: block %lld (d %.9g / %.9g)", dtype,
                    static_cast<long long>(b), gotk[b].d, wantk[b].d);
      fail(line);
    }
}

// fp16_at (which kernels and reference share) against the fp16 format decoded by hand, for every finite code
void check_fp16() {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const int exponent = (bits >> 10) & 31, mantissa = bits & 1023;
    if (exponent == 31) continue;
    const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                                          : std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
    const float want = bits & 0x8000 ? -magnitude : magnitude;
    const uint8_t code[2] = {static_cast<uint8_t>(bits & 0xFF), static_cast<uint8_t>(bits >> 8)};
    if (bits_of(fp16_at(code)) != bits_of(want)) {
      char line[120];
      std::snprintf(line, sizeof(line), "fp16_at(0x%04x): %.9g, the format says %.9g", bits, fp16_at(code), want);
      fail(line);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) rng.seed(std::strtoull(argv[1], nullptr, 10));
  check_fp16();
  check_type<LegacyUnsigned<kQ4_0>>();
  check_type<LegacyUnsigned<kQ4_1>>();
  check_type<LegacyUnsigned<kQ5_0>>();
  check_type<Q8_0Kernel>();
  check_type<KQuant45<kQ4_K>>();
  check_type<KQuant45<kQ5_K>>();
  check_type<Q6_KKernel>();
  for (int64_t type : {kQ4_0, kQ4_1, kQ5_0, kQ8_0, kQ4_K, kQ5_K, kQ6_K}) {
    check_dequantize<float>(type, "float32");
    check_dequantize<c10::BFloat16>(type, "bfloat16");
    check_dequantize<c10::Half>(type, "float16");
  }
  check_quantizers<float>("float32");
  check_quantizers<c10::BFloat16>("bfloat16");
  check_quantizers<c10::Half>("float16");
  const char* features = QS_ARM_I8MM ? "NEON, dotprod, i8mm" : QS_ARM_DOTPROD ? "NEON, dotprod" : "NEON";
  if (failures > 0) {
    std::fprintf(stderr, "%d mismatches (kernels built for %s)\n", failures, features);
    return 1;
  }
  std::printf("all ARM ggml kernels agree with the reference (built for %s; tiles %s)\n", features,
              QS_ARM_I8MM ? "checked" : "not built");
  return 0;
}
