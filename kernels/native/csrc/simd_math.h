// Vector math shared by the CPU kernels (paged_attention*.cpp through attention_common.h, fused.cpp): exp2, exp
// and tanh over vec.h's 16-lane vectors, the same operations in the same order on every instruction set (so the
// same bits). kernels/native/build.py hashes this header into every kernel's cache key. Every function is
// lane-wise: a lane's result does not depend on the others.
#pragma once

#include "vec.h"

namespace {

// exp2 for x <= 127, to ~1 ulp: 2^round(x) * e^(f ln2), f in [-0.5, 0.5], Taylor to degree 7; below -126
// it gives 2^-126 (attention masks those lanes to 0).
inline vf exp2_ps(vf x) {
  x = vmax(x, vset(-126.0f));
  const vf xi = round_even(x);
  const vf f = x - xi;
  vf p = vset(1.525273380405984e-05f);
  p = fmadd(p, f, vset(1.5403530393381606e-04f));
  p = fmadd(p, f, vset(1.3333558146428443e-03f));
  p = fmadd(p, f, vset(9.618129107628477e-03f));
  p = fmadd(p, f, vset(5.550410866482158e-02f));
  p = fmadd(p, f, vset(2.402265069591007e-01f));
  p = fmadd(p, f, vset(6.931471805599453e-01f));
  p = fmadd(p, f, vset(1.0f));
  return scale2(p, xi);
}

// e^x for any x, ~1 ulp: exp2 of x log2 e, clamped to [-126, 127].
inline vf exp_ps(vf x) { return exp2_ps(vmin(x * vset(1.4426950408889634f), vset(127.0f))); }

// tanh to 1.32 ulp at most (mean 0.16; measured over every fp32 of magnitude 1e-6 to 40 against double tanh),
// odd, NaN kept: |x| < 1: x + x^3 P(x^2), P minimax for the relative error (degree 6); |x| >= 1:
// 1 - 2 / (1 + e^(2|x|)), with |x| clamped to 10 (fp32 tanh is 1 from 9.011 on) so e^(2|x|) cannot overflow.
inline vf tanh_ps(vf x) {
  const vf ax = vabs(x);
  const vf u = x * x;
  vf p = vset(-3.584505757316947e-04f);
  p = fmadd(p, u, vset(2.3013600148260593e-03f));
  p = fmadd(p, u, vset(-7.946101017296314e-03f));
  p = fmadd(p, u, vset(2.148665487766266e-02f));
  p = fmadd(p, u, vset(-5.387980118393898e-02f));
  p = fmadd(p, u, vset(1.3332344591617584e-01f));
  p = fmadd(p, u, vset(-3.3333295583724976e-01f));
  const vf small = fmadd(ax, u * p, ax);
  const vf e2x = exp2_ps(vmin(ax, vset(10.0f)) * vset(2.8853900817779268f));
  const vf one = vset(1.0f);
  const vf large = one - vset(2.0f) / (one + e2x);
  const vf t = select(lt(ax, one), large, small);
  return select(isnan(x), copysign(t, x), x);
}

}  // namespace
