// Fused normalisation + activation: CPU kernels and the Python binding (CUDA kernels are in
// norm_act_cuda.cu and are called from here when built with MEDSEG_WITH_CUDA).
//
// The maths is exactly kernels/reference.py (its docstring is the contract). For x of shape
// (N, C, S) and a statistics group g (one (n, c) slice, C/G slices of a sample, or a channel over
// the batch) of M elements:
//
//   forward:   x̂ = (x − μ_g) σ_g⁻¹,  y = γ_c x̂ + β_c,  z = act(y)      (positive branch where y > 0)
//   backward:  dy = dz · act'(y),  ∂β_c = Σ dy,  ∂γ_c = Σ dy x̂,  ∂a_c = Σ dz y [y ≤ 0]  (PReLU)
//              dx = σ_g⁻¹ (γ_c dy − A_g − x̂ B_g),  A_g = Σ_g γ_c dy / M,  B_g = Σ_g γ_c dy x̂ / M
//              (dx = σ_g⁻¹ γ_c dy when stats_grad is false: statistics held fixed)
//   x̂ and y come from the saved input, or from the saved output z: y = act⁻¹(z), x̂ = (y − β_c)/γ_c.
//
// Element-wise steps are evaluated in the reference's order and rounding (-ffp-contract=off keeps
// the compiler from fusing them), so the branch y > 0 is decided on bit-identical y. Reductions
// accumulate in double over fixed chunks of a slice; chunk partials are combined in a fixed order,
// so the results do not depend on the thread count. The variance is a per-chunk two-pass (the
// chunk is still in cache for its second pass) merged with Chan's formula: no E[x²] − E[x]².
//
// Backward is two passes: (1) reductions, reading saved and grad_out; (2) element-wise dx. Pass 2
// reads element i before writing it, so grad_in may be saved or grad_out itself. No full-size
// temporaries are allocated.

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "norm_act.h"

#ifdef MEDSEG_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

// glibc's libmvec (>= 2.35) has SIMD variants of these; declaring them `simd` lets `#pragma omp simd`
// loops call them 4 (float) / 2 (double) lanes at a time, which ELU needs to keep up with torch.
// glibc only declares them so under -ffast-math, which we do not want. native.py defines
// MEDSEG_LIBMVEC (and links -lmvec) where libmvec is present.
#if defined(MEDSEG_LIBMVEC) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
extern "C" {
float expm1f(float) __attribute__((__simd__("notinbranch")));
double expm1(double) __attribute__((__simd__("notinbranch")));
float expf(float) __attribute__((__simd__("notinbranch")));
double exp(double) __attribute__((__simd__("notinbranch")));
float log1pf(float) __attribute__((__simd__("notinbranch")));
double log1p(double) __attribute__((__simd__("notinbranch")));
}
#endif

namespace medseg {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Runs f(slice, lo, hi, task) over every chunk [lo, hi) of every slice, in parallel over tasks.
template <typename F>
void for_each_chunk(const Geometry& geo, const F& f) {
  const int64_t per = chunks_per_slice(geo.S);
  at::parallel_for(0, geo.slices() * per, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = (t % per) * kChunk;
      f(t / per, lo, std::min(geo.S, lo + kChunk), t);
    }
  });
}

// Everything per channel / per group that the element-wise loops need.
template <typename T>
struct Params {
  Geometry geo;
  const T* mean;
  const T* invstd;
  const T* weight;  // null: γ = 1
  const T* bias;    // null: β = 0
  int act;
  T param;
  const T* prelu;
  int64_t prelu_numel;

  T w(int64_t c) const { return weight ? weight[c] : T(1); }
  T b(int64_t c) const { return bias ? bias[c] : T(0); }
  // Negative-side slope of the piecewise-linear activations (identity 1, relu 0), or ELU's α.
  T slope(int64_t c) const {
    switch (act) {
      case kIdentity: return T(1);
      case kRelu: return T(0);
      case kPrelu: return prelu[prelu_numel == 1 ? 0 : c];
      default: return param;  // leaky slope, ELU alpha
    }
  }
};

// Per-slice constants, hoisted out of the inner loops.
template <typename T>
struct SliceConst {
  T mu, rstd, w, b, a;
  T inv_w, inv_a;  // for inverting from the output: a multiply is far cheaper than a divide
  int64_t c, stat;
};

template <typename T>
SliceConst<T> slice_const(const Params<T>& p, int64_t slice) {
  const int64_t n = slice / p.geo.C, c = slice % p.geo.C;
  const int64_t st = p.geo.stat_of(n, c);
  const T w = p.w(c), a = p.slope(c);
  return {p.mean[st], p.invstd[st], w, p.b(c), a, T(1) / w, a != T(0) ? T(1) / a : T(0), c, st};
}

// ---------------------------------------------------------------------------------------------
// statistics

template <typename T>
void stats_cpu(const T* x, T* mean, T* invstd, const Geometry& geo, double eps) {
  const int64_t per = chunks_per_slice(geo.S);
  std::vector<double> cmean(geo.slices() * per), cm2(geo.slices() * per);
  for_each_chunk(geo, [&](int64_t slice, int64_t lo, int64_t hi, int64_t t) {
    const T* xs = x + slice * geo.S;
    const double len = double(hi - lo);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) s += double(xs[i]);
    const double m = s / len;
    double q = 0, d = 0;
#pragma omp simd reduction(+ : q, d)
    for (int64_t i = lo; i < hi; ++i) {
      const double e = double(xs[i]) - m;
      q += e * e;
      d += e;
    }
    cmean[t] = m;
    cm2[t] = q - d * d / len;  // corrected two-pass: removes the rounding error of m
  });
  const int64_t spg = geo.slices_per_stat();
  at::parallel_for(0, geo.num_stats(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      double n = 0, m = 0, m2 = 0;
      for (int64_t j = 0; j < spg; ++j) {
        const int64_t slice = geo.slice_of(g, j);
        for (int64_t k = 0; k < per; ++k) {
          const int64_t t = slice * per + k;
          merge_moments(n, m, m2, double(std::min(kChunk, geo.S - k * kChunk)), cmean[t], cm2[t]);
        }
      }
      mean[g] = T(m);
      invstd[g] = T(1.0 / std::sqrt(m2 / n + eps));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// forward

template <typename T>
void forward_cpu(const T* x, T* out, const Params<T>& p) {
  const int64_t S = p.geo.S;
  const bool elu = p.act == kElu;
  for_each_chunk(p.geo, [&](int64_t slice, int64_t lo, int64_t hi, int64_t) {
    const SliceConst<T> k = slice_const(p, slice);
    const T mu = k.mu, rstd = k.rstd, w = k.w, b = k.b, a = k.a;
    const T* xs = x + slice * S;
    T* zs = out + slice * S;  // may be xs: each element is read before it is written
    if (elu) {
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) {
        T y = (xs[i] - mu) * rstd;
        y = y * w;
        y = y + b;
        const T neg = a * std::expm1(y);  // all lanes: one SIMD call beats a mispredicted branch
        zs[i] = y > T(0) ? y : neg;
      }
    } else {
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) {
        T y = (xs[i] - mu) * rstd;
        y = y * w;
        y = y + b;
        const T neg = y * a;  // computed unconditionally so that the select vectorises
        zs[i] = y > T(0) ? y : neg;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// backward

// (y, x̂, dy) of one element, and whether it is on the positive branch, from the saved input or
// (FromOutput) the saved output z. With a > 0 (checked), y > 0 exactly when z > 0, so the branch
// is taken on z directly (this also keeps the loop free of control flow for the vectoriser).
// z·(1/a) and (y − β)·(1/γ) may differ from the reference's divisions by an ulp; the branch is
// unaffected.
template <typename T, bool Elu, bool FromOutput>
inline bool element(T s, T g, const SliceConst<T> k, T& y, T& xh, T& dy) {
  bool pos;
  if constexpr (FromOutput) {
    pos = s > T(0);
    // Both sides computed: a select vectorises, a branch does not.
    const T neg = Elu ? std::log1p(s * k.inv_a) : s * k.inv_a;
    y = pos ? s : neg;
    xh = (y - k.b) * k.inv_w;
  } else {
    xh = (s - k.mu) * k.rstd;
    y = xh * k.w;
    y = y + k.b;
    pos = y > T(0);
  }
  // dz/dy on the negative side: a, or for ELU α eʸ, which is z + α when z was saved.
  const T neg = !Elu ? g * k.a : FromOutput ? g * (s + k.a) : g * k.a * std::exp(y);
  dy = pos ? g : neg;
  return pos;
}

// Pass 1 over one chunk: Σ dy, Σ dy·x̂, Σ dz·y[y ≤ 0].
template <typename T, bool Elu, bool FromOutput>
void reduce_chunk(const T* sv, const T* go, const SliceConst<T> k, int64_t lo, int64_t hi, double* out3) {
  double s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s1, s2, s3)
  for (int64_t i = lo; i < hi; ++i) {
    T y, xh, dy;
    const T g = go[i];
    const bool pos = element<T, Elu, FromOutput>(sv[i], g, k, y, xh, dy);
    const double gy = double(g) * double(y);
    s1 += double(dy);
    s2 += double(dy) * double(xh);
    s3 += pos ? 0.0 : gy;
  }
  out3[0] = s1;
  out3[1] = s2;
  out3[2] = s3;
}

// Pass 2 over one chunk: dx = σ⁻¹ ((γ dy − A) − x̂ B), or (γ dy) σ⁻¹ without statistics gradient.
template <typename T, bool Elu, bool FromOutput, bool StatsGrad>
void dx_chunk(const T* sv, const T* go, T* gi, const SliceConst<T> k, T A, T B, int64_t lo, int64_t hi) {
  const T w = k.w, rstd = k.rstd;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    T y, xh, dy;
    element<T, Elu, FromOutput>(sv[i], go[i], k, y, xh, dy);
    const T dxh = dy * w;
    if constexpr (StatsGrad) {
      gi[i] = rstd * ((dxh - A) - xh * B);
    } else {
      gi[i] = dxh * rstd;
    }
  }
}

template <typename T, bool Elu, bool FromOutput>
void backward_cpu_impl(const T* sv, const T* go, T* gi, const Params<T>& p, bool stats_grad, T* dweight,
                       T* dbias, T* dprelu) {
  const Geometry& geo = p.geo;
  const int64_t S = geo.S, C = geo.C, per = chunks_per_slice(S);
  const bool need_sums = stats_grad || dweight || dbias || dprelu;

  // Pass 1: chunk partials, then per slice (chunks in order), then per channel / group (slices in
  // order): deterministic.
  std::vector<double> slice_sums(3 * geo.slices(), 0.0);
  if (need_sums) {
    std::vector<double> part(3 * geo.slices() * per);
    for_each_chunk(geo, [&](int64_t slice, int64_t lo, int64_t hi, int64_t t) {
      const SliceConst<T> k = slice_const(p, slice);
      reduce_chunk<T, Elu, FromOutput>(sv + slice * S, go + slice * S, k, lo, hi, &part[3 * t]);
    });
    for (int64_t s = 0; s < geo.slices(); ++s)
      for (int64_t k = 0; k < per; ++k)
        for (int r = 0; r < 3; ++r) slice_sums[3 * s + r] += part[3 * (s * per + k) + r];
  }
  auto per_channel = [&](int64_t c, int r) {
    double acc = 0;
    for (int64_t n = 0; n < geo.N; ++n) acc += slice_sums[3 * (n * C + c) + r];
    return acc;
  };
  for (int64_t c = 0; c < C; ++c) {
    if (dbias) dbias[c] = T(per_channel(c, 0));
    if (dweight) dweight[c] = T(per_channel(c, 1));
  }
  if (dprelu) {
    if (p.prelu_numel == 1) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += per_channel(c, 2);
      dprelu[0] = T(acc);
    } else {
      for (int64_t c = 0; c < C; ++c) dprelu[c] = T(per_channel(c, 2));
    }
  }
  std::vector<T> A(geo.num_stats(), T(0)), B(geo.num_stats(), T(0));
  if (stats_grad) {
    const int64_t spg = geo.slices_per_stat();
    const double M = double(geo.group_elems());
    for (int64_t g = 0; g < geo.num_stats(); ++g) {
      double a = 0, b = 0;
      for (int64_t j = 0; j < spg; ++j) {
        const int64_t s = geo.slice_of(g, j);
        const double w = double(p.w(s % C));
        a += w * slice_sums[3 * s];
        b += w * slice_sums[3 * s + 1];
      }
      A[g] = T(a / M);
      B[g] = T(b / M);
    }
  }

  // Pass 2: element-wise, safe when gi aliases sv or go.
  for_each_chunk(geo, [&](int64_t slice, int64_t lo, int64_t hi, int64_t) {
    const SliceConst<T> k = slice_const(p, slice);
    const int64_t off = slice * S;
    if (stats_grad)
      dx_chunk<T, Elu, FromOutput, true>(sv + off, go + off, gi + off, k, A[k.stat], B[k.stat], lo, hi);
    else
      dx_chunk<T, Elu, FromOutput, false>(sv + off, go + off, gi + off, k, T(0), T(0), lo, hi);
  });
}

template <typename T>
void backward_cpu(const T* sv, const T* go, T* gi, const Params<T>& p, bool from_output, bool stats_grad,
                  T* dweight, T* dbias, T* dprelu) {
  const bool elu = p.act == kElu;
  if (elu && from_output)
    backward_cpu_impl<T, true, true>(sv, go, gi, p, stats_grad, dweight, dbias, dprelu);
  else if (elu)
    backward_cpu_impl<T, true, false>(sv, go, gi, p, stats_grad, dweight, dbias, dprelu);
  else if (from_output)
    backward_cpu_impl<T, false, true>(sv, go, gi, p, stats_grad, dweight, dbias, dprelu);
  else
    backward_cpu_impl<T, false, false>(sv, go, gi, p, stats_grad, dweight, dbias, dprelu);
}

// ---------------------------------------------------------------------------------------------
// argument checking and dispatch

const char* const kNormNames[] = {"instance", "group", "batch"};

Geometry check_input(const Tensor& x, const char* name, int64_t norm, int64_t groups) {
  TORCH_CHECK(x.defined(), "medseg norm_act: ", name, " is undefined");
  TORCH_CHECK(x.dim() >= 2, "medseg norm_act: ", name, " must have shape (N, C, *spatial), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "medseg norm_act: ", name, " must be float32 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "medseg norm_act: ", name,
              " must be contiguous (N, C, *spatial) (channels-last and strided views are not supported)");
  TORCH_CHECK(norm >= 0 && norm <= 2, "medseg norm_act: norm must be 0 (instance), 1 (group) or 2 (batch), got ",
              norm);
  Geometry geo{x.size(0), x.size(1), 1, 1, int(norm)};
  for (int64_t d = 2; d < x.dim(); ++d) geo.S *= x.size(d);
  if (norm == kGroup) {
    TORCH_CHECK(groups >= 1 && geo.C % groups == 0, "medseg norm_act: groups (", groups,
                ") must be >= 1 and divide the number of channels (", geo.C, ")");
    geo.G = groups;
  }
  return geo;
}

void check_like(const Tensor& t, const Tensor& x, const char* name, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "medseg norm_act: ", name, " must have dtype ",
              x.scalar_type(), " like the input, got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), "medseg norm_act: ", name, " is on ", t.device(), " but the input is on ",
              x.device());
  TORCH_CHECK(t.is_contiguous(), "medseg norm_act: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "medseg norm_act: ", name, " must have ", numel, " elements (", what, "), got ",
              t.numel(), " (shape ", t.sizes(), ")");
}

void check_same_shape(const Tensor& t, const Tensor& x, const char* name, const char* xname) {
  TORCH_CHECK(t.defined() && t.sizes() == x.sizes(), "medseg norm_act: ", name, " must have the shape of ", xname,
              " ", x.sizes(), ", got ", t.defined() ? t.sizes() : at::IntArrayRef{});
  check_like(t, x, name, x.numel(), "the input's shape");
}

// out may be exactly `in` (in place) but must not partially overlap it.
void check_alias(const Tensor& out, const Tensor& in, const char* oname, const char* iname) {
  const auto status = at::get_overlap_status(out, in);
  TORCH_CHECK(status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::No, "medseg norm_act: ", oname,
              " must be ", iname, " itself or not overlap it");
}

struct Checked {
  Geometry geo;
  int64_t prelu_numel = 0;
};

Checked check_params(const Tensor& x, const Tensor& mean, const Tensor& invstd, const OptTensor& weight,
                     const OptTensor& bias, int64_t norm, int64_t groups, int64_t act, double param,
                     const OptTensor& prelu, bool from_output) {
  Checked r{check_input(x, "input", norm, groups)};
  const Geometry& geo = r.geo;
  const char* stats_what = norm == kInstance ? "N*C" : norm == kGroup ? "N*groups" : "C";
  check_like(mean, x, "mean", geo.num_stats(), stats_what);
  check_like(invstd, x, "invstd", geo.num_stats(), stats_what);
  if (weight) check_like(*weight, x, "weight", geo.C, "one per channel");
  if (bias) check_like(*bias, x, "bias", geo.C, "one per channel");
  TORCH_CHECK(act >= 0 && act <= 4,
              "medseg norm_act: act must be 0 (identity), 1 (relu), 2 (leaky_relu), 3 (prelu) or 4 (elu), got ", act);
  if (act == kPrelu) {
    TORCH_CHECK(prelu.has_value() && prelu->defined(), "medseg norm_act: act=prelu needs the prelu slope tensor");
    r.prelu_numel = prelu->numel();
    TORCH_CHECK(r.prelu_numel == 1 || r.prelu_numel == geo.C, "medseg norm_act: prelu must have 1 or C (", geo.C,
                ") elements, got ", r.prelu_numel);
    check_like(*prelu, x, "prelu", r.prelu_numel, "1 or C");
  }
  if (from_output) {
    TORCH_CHECK(act != kRelu,
                "medseg norm_act: relu is not invertible; backward from the output is not possible, keep the input "
                "(from_output=False)");
    TORCH_CHECK(act != kLeakyRelu || param > 0, "medseg norm_act: backward from the output needs a leaky_relu slope "
                                                "> 0 to invert the activation, got ", param);
    TORCH_CHECK(act != kElu || param > 0, "medseg norm_act: backward from the output needs ELU alpha > 0, got ",
                param);
    // Cheap on CPU (C values); on CUDA it would synchronise, so the caller's contract covers it there.
    if (!x.is_cuda()) {
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_check_invertible", [&] {
        if (weight) {
          const scalar_t* w = weight->data_ptr<scalar_t>();
          for (int64_t c = 0; c < geo.C; ++c)
            TORCH_CHECK(w[c] != scalar_t(0), "medseg norm_act: backward from the output needs weight != 0 (channel ",
                        c, " is 0)");
        }
        if (act == kPrelu) {
          const scalar_t* a = prelu->data_ptr<scalar_t>();
          for (int64_t c = 0; c < r.prelu_numel; ++c)
            TORCH_CHECK(a[c] > scalar_t(0), "medseg norm_act: backward from the output needs prelu slopes > 0 (",
                        "element ", c, " is ", a[c], ")");
        }
      });
    }
  }
  return r;
}

template <typename T>
Params<T> make_params(const Checked& ck, const Tensor& mean, const Tensor& invstd, const OptTensor& weight,
                      const OptTensor& bias, int64_t act, double param, const OptTensor& prelu) {
  return Params<T>{ck.geo,
                   mean.data_ptr<T>(),
                   invstd.data_ptr<T>(),
                   weight ? weight->data_ptr<T>() : nullptr,
                   bias ? bias->data_ptr<T>() : nullptr,
                   int(act),
                   T(param),
                   act == kPrelu ? prelu->data_ptr<T>() : nullptr,
                   ck.prelu_numel};
}

#ifdef MEDSEG_WITH_CUDA
#define MEDSEG_CUDA_CHECK(expr)                                                                  \
  do {                                                                                         \
    const cudaError_t err_ = (expr);                                                           \
    TORCH_CHECK(err_ == cudaSuccess, "medseg norm_act CUDA kernel failed: ", cudaGetErrorString(err_)); \
  } while (0)
#else
void no_cuda(const Tensor& x) {
  TORCH_CHECK(!x.is_cuda(), "medseg norm_act: the native kernels were built without CUDA support; got a ", x.device(),
              " tensor (use the reference path, or rebuild on a machine with a CUDA toolkit)");
}
#endif

void check_device(const Tensor& x) {
#ifndef MEDSEG_WITH_CUDA
  no_cuda(x);
#endif
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "medseg norm_act: unsupported device ", x.device());
}

Tensor opt_undefined(const OptTensor& t) { return t ? *t : Tensor(); }

// ---------------------------------------------------------------------------------------------
// the three ops

std::tuple<Tensor, Tensor> norm_stats(const Tensor& x, int64_t norm, int64_t groups, double eps) {
  const Geometry geo = check_input(x, "input", norm, groups);
  check_device(x);
  TORCH_CHECK(geo.N > 0 && geo.C > 0 && geo.S > 0, "medseg norm_act: statistics of an empty tensor ", x.sizes());
  TORCH_CHECK(eps >= 0, "medseg norm_act: eps must be >= 0, got ", eps);
  std::vector<int64_t> shape = norm == kBatch ? std::vector<int64_t>{geo.C}
                                              : std::vector<int64_t>{geo.N, norm == kGroup ? geo.G : geo.C};
  Tensor mean = at::empty(shape, x.options()), invstd = at::empty(shape, x.options());
  if (x.is_cuda()) {
#ifdef MEDSEG_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    Tensor work = at::empty({cuda::work_doubles(geo)}, x.options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_norm_stats_cuda", [&] {
      MEDSEG_CUDA_CHECK(cuda::norm_stats<scalar_t>(x.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(),
                                                   invstd.data_ptr<scalar_t>(), geo, eps, work.data_ptr<double>(),
                                                   c10::cuda::getCurrentCUDAStream().stream()));
    });
#endif
    return {mean, invstd};
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_norm_stats_cpu", [&] {
    stats_cpu<scalar_t>(x.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), invstd.data_ptr<scalar_t>(), geo, eps);
  });
  return {mean, invstd};
}

void forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const OptTensor& weight,
             const OptTensor& bias, int64_t norm, int64_t groups, int64_t act, double param, const OptTensor& prelu,
             const Tensor& out) {
  const Checked ck = check_params(x, mean, invstd, weight, bias, norm, groups, act, param, prelu, false);
  check_device(x);
  check_same_shape(out, x, "out", "the input");
  check_alias(out, x, "out", "the input");
  if (x.numel() == 0) return;
  if (x.is_cuda()) {
#ifdef MEDSEG_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_forward_cuda", [&] {
      const Params<scalar_t> p = make_params<scalar_t>(ck, mean, invstd, weight, bias, act, param, prelu);
      MEDSEG_CUDA_CHECK(cuda::forward<scalar_t>(x.data_ptr<scalar_t>(), p.mean, p.invstd, p.weight, p.bias, ck.geo,
                                                int(act), param, p.prelu, ck.prelu_numel, out.data_ptr<scalar_t>(),
                                                c10::cuda::getCurrentCUDAStream().stream()));
    });
#endif
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_forward_cpu", [&] {
    forward_cpu<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                          make_params<scalar_t>(ck, mean, invstd, weight, bias, act, param, prelu));
  });
}

std::tuple<OptTensor, OptTensor, OptTensor> backward(const Tensor& saved, const Tensor& grad_out, const Tensor& mean,
                                                     const Tensor& invstd, const OptTensor& weight,
                                                     const OptTensor& bias, int64_t norm, int64_t groups, int64_t act,
                                                     double param, const OptTensor& prelu, bool from_output,
                                                     bool stats_grad, const Tensor& grad_in) {
  const Checked ck =
      check_params(saved, mean, invstd, weight, bias, norm, groups, act, param, prelu, from_output);
  check_device(saved);
  check_same_shape(grad_out, saved, "grad_out", "saved");
  check_same_shape(grad_in, saved, "grad_in", "saved");
  check_alias(grad_in, saved, "grad_in", "saved");
  check_alias(grad_in, grad_out, "grad_in", "grad_out");
  OptTensor dweight, dbias, dprelu;
  if (weight) dweight = at::empty_like(*weight);
  if (bias) dbias = at::empty_like(*bias);
  if (act == kPrelu) dprelu = at::empty_like(*prelu);
  if (saved.numel() == 0) {  // sums over nothing
    for (OptTensor* t : {&dweight, &dbias, &dprelu})
      if (*t) (*t)->zero_();
    return {dweight, dbias, dprelu};
  }
  if (saved.is_cuda()) {
#ifdef MEDSEG_WITH_CUDA
    c10::cuda::CUDAGuard guard(saved.device());
    Tensor work = at::empty({cuda::work_doubles(ck.geo)}, saved.options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES(saved.scalar_type(), "medseg_backward_cuda", [&] {
      const Params<scalar_t> p = make_params<scalar_t>(ck, mean, invstd, weight, bias, act, param, prelu);
      MEDSEG_CUDA_CHECK(cuda::backward<scalar_t>(
          saved.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(), p.mean, p.invstd, p.weight, p.bias, ck.geo,
          int(act), param, p.prelu, ck.prelu_numel, from_output, stats_grad, grad_in.data_ptr<scalar_t>(),
          dweight ? dweight->data_ptr<scalar_t>() : nullptr, dbias ? dbias->data_ptr<scalar_t>() : nullptr,
          dprelu ? dprelu->data_ptr<scalar_t>() : nullptr, work.data_ptr<double>(),
          c10::cuda::getCurrentCUDAStream().stream()));
    });
#endif
    return {dweight, dbias, dprelu};
  }
  AT_DISPATCH_FLOATING_TYPES(saved.scalar_type(), "medseg_backward_cpu", [&] {
    backward_cpu<scalar_t>(saved.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(), grad_in.data_ptr<scalar_t>(),
                           make_params<scalar_t>(ck, mean, invstd, weight, bias, act, param, prelu), from_output,
                           stats_grad, dweight ? dweight->data_ptr<scalar_t>() : nullptr,
                           dbias ? dbias->data_ptr<scalar_t>() : nullptr,
                           dprelu ? dprelu->data_ptr<scalar_t>() : nullptr);
  });
  return {dweight, dbias, dprelu};
}

bool with_cuda() {
#ifdef MEDSEG_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
void register_dice_ce(pybind11::module_& m);  // dice_ce_cpu.cpp
}  // namespace medseg

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace pybind11::literals;
  m.doc() = "medseg fused normalisation + activation kernels (maths: medseg.kernels.reference)";
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("norm_stats", &medseg::norm_stats, "Per-group (mean, invstd), biased variance, accumulated in double",
        "x"_a, "norm"_a, "groups"_a, "eps"_a, nogil);
  m.def("forward", &medseg::forward, "Writes act(γ (x − μ) σ⁻¹ + β) into out (out may be x)", "x"_a, "mean"_a,
        "invstd"_a, "weight"_a, "bias"_a, "norm"_a, "groups"_a, "act"_a, "param"_a, "prelu"_a, "out"_a, nogil);
  m.def("backward", &medseg::backward,
        "Writes dx into grad_in (may be saved or grad_out); returns (dweight, dbias, dprelu), None where absent",
        "saved"_a, "grad_out"_a, "mean"_a, "invstd"_a, "weight"_a, "bias"_a, "norm"_a, "groups"_a, "act"_a, "param"_a,
        "prelu"_a, "from_output"_a, "stats_grad"_a, "grad_in"_a, nogil);
  m.def("with_cuda", &medseg::with_cuda, "Whether this build has the CUDA kernels");
  medseg::register_dice_ce(m);
}
