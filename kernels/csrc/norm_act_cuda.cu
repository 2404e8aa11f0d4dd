// Fused normalisation + activation: CUDA kernels. Same maths, order of operations and chunked,
// order-fixed double reductions as norm_act_cpu.cpp (see its header and kernels/reference.py).
// Plain CUDA C++ (no torch/ATen) so that it also compiles with bare nvcc; norm_act_cpu.cpp calls
// the launchers declared in norm_act.h.
//
// Work decomposition: a "task" is a chunk of kChunk elements of one (n, c) slice, one block per
// task. Reductions write per-task double partials to `work`; a small combine kernel (one thread per
// statistics group / channel) merges them in a fixed order, so results are deterministic.
// Element-wise products and sums use __*_rn intrinsics so that nvcc does not contract them into
// FMAs: y must round exactly as in the reference for the y > 0 branch to agree.

#include <cuda_runtime.h>

#include <cstdint>

#include "norm_act.h"

namespace medseg::cuda {
namespace {

constexpr int kThreads = 256;

// Round-to-nearest arithmetic without contraction, and the math functions, per precision.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float expm1_(float a) { return expm1f(a); }
__device__ __forceinline__ double expm1_(double a) { return expm1(a); }
__device__ __forceinline__ float exp_(float a) { return expf(a); }
__device__ __forceinline__ double exp_(double a) { return exp(a); }
__device__ __forceinline__ float log1p_(float a) { return log1pf(a); }
__device__ __forceinline__ double log1p_(double a) { return log1p(a); }

template <typename T>
struct Params {
  Geometry geo;
  const T* mean;
  const T* invstd;
  const T* weight;
  const T* bias;
  int act;
  T param;
  const T* prelu;
  int64_t prelu_numel;
};

template <typename T>
struct SliceConst {
  T mu, rstd, w, b, a;
  int64_t stat;
};

template <typename T>
__device__ SliceConst<T> slice_const(const Params<T>& p, int64_t slice) {
  const int64_t n = slice / p.geo.C, c = slice % p.geo.C;
  SliceConst<T> k;
  k.stat = p.geo.stat_of(n, c);
  k.mu = p.mean[k.stat];
  k.rstd = p.invstd[k.stat];
  k.w = p.weight ? p.weight[c] : T(1);
  k.b = p.bias ? p.bias[c] : T(0);
  switch (p.act) {
    case kIdentity: k.a = T(1); break;
    case kRelu: k.a = T(0); break;
    case kPrelu: k.a = p.prelu[p.prelu_numel == 1 ? 0 : c]; break;
    default: k.a = p.param;  // leaky slope, ELU alpha
  }
  return k;
}

// Deterministic block sum of R doubles (fixed tree for a fixed block size); result in thread 0.
template <int R>
__device__ void block_sum(double (&v)[R]) {
  __shared__ double sh[R][kThreads];
  for (int r = 0; r < R; ++r) sh[r][threadIdx.x] = v[r];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride)
      for (int r = 0; r < R; ++r) sh[r][threadIdx.x] += sh[r][threadIdx.x + stride];
    __syncthreads();
  }
  for (int r = 0; r < R; ++r) v[r] = sh[r][0];
  __syncthreads();  // sh may be reused by the caller's next block_sum
}

// ---------------------------------------------------------------------------------------------
// statistics

template <typename T>
__global__ void chunk_moments_kernel(const T* __restrict__ x, Geometry geo, int64_t per, double* __restrict__ work) {
  const int64_t t = blockIdx.x;
  const int64_t slice = t / per, lo = (t % per) * kChunk;
  const int64_t hi = lo + kChunk < geo.S ? lo + kChunk : geo.S;
  const T* xs = x + slice * geo.S;
  double s[1] = {0};
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) s[0] += double(xs[i]);
  block_sum<1>(s);
  const double len = double(hi - lo), m = s[0] / len;
  double qd[2] = {0, 0};
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const double e = double(xs[i]) - m;
    qd[0] += e * e;
    qd[1] += e;
  }
  block_sum<2>(qd);
  if (threadIdx.x == 0) {
    work[2 * t] = m;
    work[2 * t + 1] = qd[0] - qd[1] * qd[1] / len;  // corrected two-pass
  }
}

template <typename T>
__global__ void combine_moments_kernel(const double* __restrict__ work, Geometry geo, int64_t per, double eps,
                                       T* __restrict__ mean, T* __restrict__ invstd) {
  const int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (g >= geo.num_stats()) return;
  double n = 0, m = 0, m2 = 0;
  for (int64_t j = 0; j < geo.slices_per_stat(); ++j) {
    const int64_t slice = geo.slice_of(g, j);
    for (int64_t k = 0; k < per; ++k) {
      const int64_t t = slice * per + k;
      const int64_t len = geo.S - k * kChunk < kChunk ? geo.S - k * kChunk : kChunk;
      merge_moments(n, m, m2, double(len), work[2 * t], work[2 * t + 1]);
    }
  }
  mean[g] = T(m);
  invstd[g] = T(1.0 / sqrt(m2 / n + eps));
}

// ---------------------------------------------------------------------------------------------
// forward

template <typename T>
__global__ void forward_kernel(const T* x, Params<T> p, int64_t per, T* out) {  // out may be x
  const int64_t t = blockIdx.x;
  const int64_t slice = t / per, lo = (t % per) * kChunk;
  const int64_t hi = lo + kChunk < p.geo.S ? lo + kChunk : p.geo.S;
  const SliceConst<T> k = slice_const(p, slice);
  const T* xs = x + slice * p.geo.S;
  T* zs = out + slice * p.geo.S;
  const bool elu = p.act == kElu;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const T y = add(mul(mul(sub(xs[i], k.mu), k.rstd), k.w), k.b);
    zs[i] = y > T(0) ? y : elu ? mul(k.a, expm1_(y)) : mul(y, k.a);
  }
}

// ---------------------------------------------------------------------------------------------
// backward

struct Flags {
  bool elu, from_output, stats_grad;
};

// (y, x̂, dy) of one element, from the saved input or output.
template <typename T>
__device__ __forceinline__ void element(T s, T g, const SliceConst<T>& k, Flags f, T& y, T& xh, T& dy) {
  if (f.from_output) {
    y = s > T(0) ? s : f.elu ? log1p_(div(s, k.a)) : div(s, k.a);
    xh = div(sub(y, k.b), k.w);
  } else {
    xh = mul(sub(s, k.mu), k.rstd);
    y = add(mul(xh, k.w), k.b);
  }
  if (y > T(0)) {
    dy = g;
  } else if (f.elu) {
    dy = f.from_output ? mul(g, add(s, k.a)) : mul(mul(g, k.a), exp_(y));  // α eʸ = z + α
  } else {
    dy = mul(g, k.a);
  }
}

template <typename T>
__global__ void backward_reduce_kernel(const T* saved, const T* grad_out, Params<T> p, Flags f, int64_t per,
                                       double* __restrict__ work) {
  const int64_t t = blockIdx.x;
  const int64_t slice = t / per, lo = (t % per) * kChunk;
  const int64_t hi = lo + kChunk < p.geo.S ? lo + kChunk : p.geo.S;
  const SliceConst<T> k = slice_const(p, slice);
  const T* sv = saved + slice * p.geo.S;
  const T* go = grad_out + slice * p.geo.S;
  double s[3] = {0, 0, 0};
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    T y, xh, dy;
    const T g = go[i];
    element(sv[i], g, k, f, y, xh, dy);
    s[0] += double(dy);
    s[1] += double(dy) * double(xh);
    if (!(y > T(0))) s[2] += double(g) * double(y);
  }
  block_sum<3>(s);
  if (threadIdx.x == 0)
    for (int r = 0; r < 3; ++r) work[3 * t + r] = s[r];
}

// Thread i < C: channel sums (dβ, dγ, dPReLU per channel); thread i < num_stats: A_g, B_g into
// work (after the 3 * tasks partials); thread 0 also the scalar PReLU slope gradient.
template <typename T>
__global__ void backward_combine_kernel(Params<T> p, int64_t per, bool stats_grad, double* work, T* dweight,
                                        T* dbias, T* dprelu) {
  const Geometry& geo = p.geo;
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t tasks = geo.slices() * per;
  auto slice_sum = [&](int64_t slice, int r) {
    double acc = 0;
    for (int64_t k = 0; k < per; ++k) acc += work[3 * (slice * per + k) + r];
    return acc;
  };
  if (i < geo.C) {
    double sb = 0, sw = 0, sa = 0;
    for (int64_t n = 0; n < geo.N; ++n) {
      sb += slice_sum(n * geo.C + i, 0);
      sw += slice_sum(n * geo.C + i, 1);
      sa += slice_sum(n * geo.C + i, 2);
    }
    if (dbias) dbias[i] = T(sb);
    if (dweight) dweight[i] = T(sw);
    if (dprelu && p.prelu_numel > 1) dprelu[i] = T(sa);
  }
  if (i == 0 && dprelu && p.prelu_numel == 1) {
    double acc = 0;
    for (int64_t c = 0; c < geo.C; ++c) {
      double sa = 0;
      for (int64_t n = 0; n < geo.N; ++n) sa += slice_sum(n * geo.C + c, 2);
      acc += sa;  // same order as the CPU: per channel over n, then over channels
    }
    dprelu[0] = T(acc);
  }
  if (stats_grad && i < geo.num_stats()) {
    double a = 0, b = 0;
    for (int64_t j = 0; j < geo.slices_per_stat(); ++j) {
      const int64_t slice = geo.slice_of(i, j);
      const double w = p.weight ? double(p.weight[slice % geo.C]) : 1.0;
      a += w * slice_sum(slice, 0);
      b += w * slice_sum(slice, 1);
    }
    const double M = double(geo.group_elems());
    work[3 * tasks + 2 * i] = a / M;
    work[3 * tasks + 2 * i + 1] = b / M;
  }
}

template <typename T>
__global__ void backward_dx_kernel(const T* saved, const T* grad_out, Params<T> p, Flags f, int64_t per,
                                   const double* __restrict__ AB, T* grad_in) {  // grad_in may alias
  const int64_t t = blockIdx.x;
  const int64_t slice = t / per, lo = (t % per) * kChunk;
  const int64_t hi = lo + kChunk < p.geo.S ? lo + kChunk : p.geo.S;
  const SliceConst<T> k = slice_const(p, slice);
  const T A = f.stats_grad ? T(AB[2 * k.stat]) : T(0), B = f.stats_grad ? T(AB[2 * k.stat + 1]) : T(0);
  const int64_t off = slice * p.geo.S;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    T y, xh, dy;
    element(saved[off + i], grad_out[off + i], k, f, y, xh, dy);
    const T dxh = mul(dy, k.w);
    grad_in[off + i] = f.stats_grad ? mul(k.rstd, sub(sub(dxh, A), mul(xh, B))) : mul(dxh, k.rstd);
  }
}

int blocks_for(int64_t n, int threads) { return int((n + threads - 1) / threads); }

template <typename T>
Params<T> make_params(const T* mean, const T* invstd, const T* weight, const T* bias, Geometry geo, int act,
                      double param, const T* prelu, int64_t prelu_numel) {
  return Params<T>{geo, mean, invstd, weight, bias, act, T(param), prelu, prelu_numel};
}

}  // namespace

// Grid sizes: tasks = N*C*ceil(S/kChunk) blocks; gridDim.x allows 2^31 - 1.

template <typename T>
cudaError_t norm_stats(const T* x, T* mean, T* invstd, Geometry geo, double eps, double* work, cudaStream_t stream) {
  const int64_t per = chunks_per_slice(geo.S);
  if (geo.slices() * per == 0) return cudaSuccess;
  chunk_moments_kernel<T><<<unsigned(geo.slices() * per), kThreads, 0, stream>>>(x, geo, per, work);
  combine_moments_kernel<T><<<blocks_for(geo.num_stats(), 128), 128, 0, stream>>>(work, geo, per, eps, mean, invstd);
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward(const T* x, const T* mean, const T* invstd, const T* weight, const T* bias, Geometry geo, int act,
                    double param, const T* prelu, int64_t prelu_numel, T* out, cudaStream_t stream) {
  const int64_t per = chunks_per_slice(geo.S);
  if (geo.slices() * per == 0) return cudaSuccess;
  const Params<T> p = make_params(mean, invstd, weight, bias, geo, act, param, prelu, prelu_numel);
  forward_kernel<T><<<unsigned(geo.slices() * per), kThreads, 0, stream>>>(x, p, per, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const T* saved, const T* grad_out, const T* mean, const T* invstd, const T* weight, const T* bias,
                     Geometry geo, int act, double param, const T* prelu, int64_t prelu_numel, bool from_output,
                     bool stats_grad, T* grad_in, T* dweight, T* dbias, T* dprelu, double* work,
                     cudaStream_t stream) {
  const int64_t per = chunks_per_slice(geo.S), tasks = geo.slices() * per;
  if (tasks == 0) return cudaSuccess;
  const Params<T> p = make_params(mean, invstd, weight, bias, geo, act, param, prelu, prelu_numel);
  const Flags f{act == kElu, from_output, stats_grad};
  if (stats_grad || dweight || dbias || dprelu) {
    backward_reduce_kernel<T><<<unsigned(tasks), kThreads, 0, stream>>>(saved, grad_out, p, f, per, work);
    const int64_t threads = geo.C > geo.num_stats() ? geo.C : geo.num_stats();
    backward_combine_kernel<T>
        <<<blocks_for(threads, 128), 128, 0, stream>>>(p, per, stats_grad, work, dweight, dbias, dprelu);
  }
  backward_dx_kernel<T><<<unsigned(tasks), kThreads, 0, stream>>>(saved, grad_out, p, f, per, work + 3 * tasks,
                                                                  grad_in);
  return cudaGetLastError();
}

#define MEDSEG_INSTANTIATE(T)                                                                                      \
  template cudaError_t norm_stats<T>(const T*, T*, T*, Geometry, double, double*, cudaStream_t);                  \
  template cudaError_t forward<T>(const T*, const T*, const T*, const T*, const T*, Geometry, int, double, const T*, \
                                  int64_t, T*, cudaStream_t);                                                       \
  template cudaError_t backward<T>(const T*, const T*, const T*, const T*, const T*, const T*, Geometry, int, double, \
                                   const T*, int64_t, bool, bool, T*, T*, T*, T*, double*, cudaStream_t);
MEDSEG_INSTANTIATE(float)
MEDSEG_INSTANTIATE(double)
#undef MEDSEG_INSTANTIATE

}  // namespace medseg::cuda
