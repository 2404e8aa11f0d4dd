// Fused Dice + cross-entropy loss: CUDA kernels (maths: kernels/loss.py; CPU twin: dice_ce_cpu.cpp).
// Plain CUDA C++ (no torch/ATen) so that it compiles with bare nvcc.
//
// Forward: each thread owns kVpt voxels of one sample (consecutive threads, consecutive voxels, so
// the class-strided reads coalesce), keeps their max and Σ exp in registers, then for each class
// sums p, p·[y = c] and [y = c] over its voxels, reduces them across the warp with shuffles and
// adds the warp's sums to the (N, C, 3) double stats with atomicAdd (sm_60+). Results are therefore
// summed in a run-dependent order (last-bit differences between runs, unlike the CPU kernel).
// Backward: one thread per voxel, no reductions, no temporaries.

#include <cuda_runtime.h>

#include <cstdint>

#include "dice_ce.h"

namespace medseg::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVpt = 4;  // voxels per thread in forward

__device__ __forceinline__ float exp_(float a) { return expf(a); }
__device__ __forceinline__ double exp_(double a) { return exp(a); }

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

template <typename T, typename L>
__global__ void forward_kernel(const T* __restrict__ x, const L* __restrict__ y, int64_t C, int64_t S,
                               int64_t blocks_per_sample, double* stats, double* ce) {
  const int64_t n = blockIdx.x / blocks_per_sample;
  const int64_t base = (blockIdx.x % blocks_per_sample) * int64_t(kThreads) * kVpt + threadIdx.x;
  const T* xn = x + n * C * S;
  const L* yn = y + n * S;
  T m[kVpt], se[kVpt];
  int64_t lab[kVpt];
  bool valid[kVpt];
  double ce_sum = 0, bad = 0;
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int64_t s = base + int64_t(v) * kThreads;
    valid[v] = s < S;
    m[v] = T(0);
    se[v] = T(1);
    lab[v] = -1;
    if (!valid[v]) continue;
    T mx = xn[s];
    for (int64_t c = 1; c < C; ++c) mx = max(mx, xn[c * S + s]);
    T sum = 0;
    for (int64_t c = 0; c < C; ++c) sum += exp_(xn[c * S + s] - mx);
    m[v] = mx;
    se[v] = sum;
    lab[v] = int64_t(yn[s]);
    if (lab[v] < 0 || lab[v] >= C) {
      bad += 1;
      lab[v] = -1;
    } else {
      ce_sum += double(mx) + log(double(sum)) - double(xn[lab[v] * S + s]);
    }
  }
  const int lane = threadIdx.x & 31;
  for (int64_t c = 0; c < C; ++c) {
    double sp = 0, si = 0, sg = 0;
#pragma unroll
    for (int v = 0; v < kVpt; ++v) {
      if (!valid[v]) continue;
      const int64_t s = base + int64_t(v) * kThreads;
      const double p = double(exp_(xn[c * S + s] - m[v]) / se[v]);
      sp += p;
      if (lab[v] == c) {
        si += p;
        sg += 1;
      }
    }
    sp = warp_sum(sp);
    si = warp_sum(si);
    sg = warp_sum(sg);
    if (lane == 0) {
      double* st = stats + (n * C + c) * 3;
      if (si != 0) atomicAdd(st, si);
      if (sp != 0) atomicAdd(st + 1, sp);
      if (sg != 0) atomicAdd(st + 2, sg);
    }
  }
  ce_sum = warp_sum(ce_sum);
  bad = warp_sum(bad);
  if (lane == 0) {
    atomicAdd(ce + 2 * n, ce_sum);
    if (bad != 0) atomicAdd(ce + 2 * n + 1, bad);
  }
}

template <typename T, typename L>
__global__ void backward_kernel(const T* __restrict__ x, const L* __restrict__ y, int64_t N, int64_t C, int64_t S,
                                const double* __restrict__ a, const double* __restrict__ b,
                                const double* __restrict__ e, T* __restrict__ dx) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= N * S) return;
  const int64_t n = idx / S, s = idx % S;
  const T* xn = x + n * C * S;
  T* dn = dx + n * C * S;
  const double* an = a + n * C;
  const double* bn = b + n * C;
  const int64_t label = int64_t(y[idx]);
  T mx = xn[s];
  for (int64_t c = 1; c < C; ++c) mx = max(mx, xn[c * S + s]);
  T sum = 0;
  for (int64_t c = 0; c < C; ++c) sum += exp_(xn[c * S + s] - mx);
  T dot = 0;
  for (int64_t c = 0; c < C; ++c) {
    const T p = exp_(xn[c * S + s] - mx) / sum;
    dot += p * T(c == label ? an[c] + bn[c] : bn[c]);
  }
  const T et = T(*e);
  for (int64_t c = 0; c < C; ++c) {
    const T p = exp_(xn[c * S + s] - mx) / sum;
    const bool hit = c == label;
    const T gc = T(hit ? an[c] + bn[c] : bn[c]);
    dn[c * S + s] = p * (gc - dot) + et * (p - (hit ? T(1) : T(0)));
  }
}

}  // namespace

template <typename T, typename L>
cudaError_t dice_ce_forward(const T* x, const L* y, int64_t N, int64_t C, int64_t S, double* stats, double* ce,
                            cudaStream_t stream) {
  const int64_t per_block = int64_t(kThreads) * kVpt;
  const int64_t blocks_per_sample = (S + per_block - 1) / per_block;
  const int64_t blocks = N * blocks_per_sample;
  if (blocks == 0) return cudaSuccess;
  forward_kernel<T, L><<<unsigned(blocks), kThreads, 0, stream>>>(x, y, C, S, blocks_per_sample, stats, ce);
  return cudaGetLastError();
}

template <typename T, typename L>
cudaError_t dice_ce_backward(const T* x, const L* y, int64_t N, int64_t C, int64_t S, const double* a,
                             const double* b, const double* e, T* grad_in, cudaStream_t stream) {
  const int64_t blocks = (N * S + kThreads - 1) / kThreads;
  if (blocks == 0) return cudaSuccess;
  backward_kernel<T, L><<<unsigned(blocks), kThreads, 0, stream>>>(x, y, N, C, S, a, b, e, grad_in);
  return cudaGetLastError();
}

#define MEDSEG_INSTANTIATE(T, L)                                                                            \
  template cudaError_t dice_ce_forward<T, L>(const T*, const L*, int64_t, int64_t, int64_t, double*, double*, \
                                             cudaStream_t);                                                \
  template cudaError_t dice_ce_backward<T, L>(const T*, const L*, int64_t, int64_t, int64_t, const double*,  \
                                              const double*, const double*, T*, cudaStream_t);
MEDSEG_INSTANTIATE(float, uint8_t)
MEDSEG_INSTANTIATE(float, int32_t)
MEDSEG_INSTANTIATE(double, uint8_t)
MEDSEG_INSTANTIATE(double, int32_t)
#undef MEDSEG_INSTANTIATE

}  // namespace medseg::cuda
