// at::parallel_for for kernel_check.cpp (see ATen.h here): the whole range on the calling thread
#pragma once

#include <cstdint>

namespace at {
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t /*grain_size*/, const F& f) {
  if (begin < end) f(begin, end);
}
}  // namespace at
