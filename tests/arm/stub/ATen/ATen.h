// What the ggml kernel headers take from ATen, for kernel_check.cpp, which builds them without PyTorch (for an
// emulated aarch64 CPU): the c10 scalar types with their conversions (to nearest even, as c10's), declarations
// of the tensor members vec.h's inline helpers name, and TORCH_CHECK, which throws. Nothing here is linked into
// the library.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace c10 {

struct Half {
  uint16_t x;
  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return from_bits_t(); }
  Half() = default;
  constexpr Half(uint16_t bits, from_bits_t) : x(bits) {}
  Half(float v) {  // aarch64's __fp16 conversion: IEEE, to nearest even
    const __fp16 h = static_cast<__fp16>(v);
    std::memcpy(&x, &h, 2);
  }
  operator float() const {
    __fp16 h;
    std::memcpy(&h, &x, 2);
    return static_cast<float>(h);
  }
};

struct BFloat16 {
  uint16_t x;
  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return from_bits_t(); }
  BFloat16() = default;
  constexpr BFloat16(uint16_t bits, from_bits_t) : x(bits) {}
  BFloat16(float v) {  // to nearest even
    uint32_t u;
    std::memcpy(&u, &v, 4);
    x = static_cast<uint16_t>(v != v ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
};

struct Float8_e4m3fn {
  uint8_t x;
};
struct Float8_e5m2 {
  uint8_t x;
};

}  // namespace c10

namespace at {
struct Device {
  bool is_cpu() const;
};
struct Tensor {
  Device device() const;
  int64_t stride(int64_t dim) const;
};
}  // namespace at

namespace qwenserve_check_stub {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
inline void append(std::ostringstream& out, const T& first, const Rest&... rest) {
  out << first;
  append(out, rest...);
}
}  // namespace qwenserve_check_stub

#define TORCH_CHECK(cond, ...)                                                                      \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      std::ostringstream torch_check_message;                                                       \
      qwenserve_check_stub::append(torch_check_message, "check failed: " #cond ". ", ##__VA_ARGS__); \
      throw std::runtime_error(torch_check_message.str());                                          \
    }                                                                                               \
  } while (0)
