// GPT-2's GELU (the tanh approximation) on one vector of fp32 lanes: the epilogue of our
// linears (blocked_linear.cpp, blocked_linear_f32.cpp), each built for its own ISA.
#pragma once

#include <ATen/cpu/vec/vec.h>

namespace rayinfer {

inline at::vec::Vectorized<float> gelu_tanh(const at::vec::Vectorized<float>& x) {
  using Vec = at::vec::Vectorized<float>;
  const Vec half(0.5f), one(1.f), alpha(0.7978845608028654f), kappa(0.044715f);  // sqrt(2 / pi)
  return half * x * (one + (alpha * (x + kappa * x * x * x)).tanh());
}

}  // namespace rayinfer
