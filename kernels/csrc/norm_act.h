// Shared declarations of the fused normalisation + activation kernels (see norm_act_cpu.cpp for
// the maths and kernels/reference.py for the contract). Plain C++: no torch/ATen includes, so that
// norm_act_cuda.cu compiles with bare nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEDSEG_HD __host__ __device__ __forceinline__
#else
#define MEDSEG_HD inline
#endif

namespace medseg {

// Integer codes shared with the Python side (medseg.kernels.native).
enum Norm : int { kInstance = 0, kGroup = 1, kBatch = 2 };
enum Act : int { kIdentity = 0, kRelu = 1, kLeakyRelu = 2, kPrelu = 3, kElu = 4 };

// A contiguous (N, C, S) tensor, S = product of the spatial sizes. A "slice" is one (n, c) row of S
// elements; a statistics group is one slice (instance), C/G slices of one sample (group) or one
// channel across the batch (batch).
struct Geometry {
  int64_t N, C, S, G;  // G: number of groups (group norm; 1 otherwise)
  int norm;

  MEDSEG_HD int64_t slices() const { return N * C; }
  MEDSEG_HD int64_t num_stats() const { return norm == kInstance ? N * C : norm == kGroup ? N * G : C; }
  // Statistics index of slice (n, c).
  MEDSEG_HD int64_t stat_of(int64_t n, int64_t c) const {
    return norm == kInstance ? n * C + c : norm == kGroup ? n * G + c / (C / G) : c;
  }
  // Number of slices in one statistics group, and elements in it (M in reference.py).
  MEDSEG_HD int64_t slices_per_stat() const { return norm == kInstance ? 1 : norm == kGroup ? C / G : N; }
  MEDSEG_HD int64_t group_elems() const { return slices_per_stat() * S; }
  // Slice index of the j-th slice of statistics group g (0 <= j < slices_per_stat()).
  MEDSEG_HD int64_t slice_of(int64_t g, int64_t j) const {
    if (norm == kInstance) return g;
    if (norm == kGroup) return (g / G) * C + (g % G) * (C / G) + j;
    return j * C + g;
  }
};

// Reductions work on chunks of kChunk elements of one slice (a "task"): 64 KiB of float32, small
// enough to stay in L2 between the two variance passes, large enough that bookkeeping is negligible.
// Fixed, so the chunk partials, and thus the results, do not depend on the thread count.
constexpr int64_t kChunk = 16384;
MEDSEG_HD int64_t chunks_per_slice(int64_t S) { return (S + kChunk - 1) / kChunk; }

// Chan et al.'s pairwise merge of (count, mean, M2) partials; order-fixed callers make it
// deterministic.
MEDSEG_HD void merge_moments(double& n_a, double& mean_a, double& m2_a, double n_b, double mean_b,
                             double m2_b) {
  if (n_b == 0) return;
  const double n = n_a + n_b;
  const double delta = mean_b - mean_a;
  mean_a += delta * (n_b / n);
  m2_a += m2_b + delta * delta * (n_a * n_b / n);
  n_a = n;
}

}  // namespace medseg

#if defined(MEDSEG_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace medseg::cuda {

// All pointers are device pointers to contiguous data. `work` is a device buffer of at least
// work_doubles(geometry) doubles, owned by the caller. Each launcher enqueues on `stream` and
// returns the launch status (cudaGetLastError()).
inline int64_t work_doubles(const Geometry& g) { return 3 * g.slices() * chunks_per_slice(g.S) + 2 * g.num_stats(); }

// mean, invstd: num_stats() elements each.
template <typename T>
cudaError_t norm_stats(const T* x, T* mean, T* invstd, Geometry geo, double eps, double* work,
                       cudaStream_t stream);

// weight, bias: C elements or null; prelu: prelu_numel (1 or C) elements or null (act != prelu).
// out may equal x.
template <typename T>
cudaError_t forward(const T* x, const T* mean, const T* invstd, const T* weight, const T* bias,
                    Geometry geo, int act, double param, const T* prelu, int64_t prelu_numel, T* out,
                    cudaStream_t stream);

// grad_in may equal saved or grad_out. dweight, dbias: C elements or null; dprelu: prelu_numel
// elements or null.
template <typename T>
cudaError_t backward(const T* saved, const T* grad_out, const T* mean, const T* invstd, const T* weight,
                     const T* bias, Geometry geo, int act, double param, const T* prelu,
                     int64_t prelu_numel, bool from_output, bool stats_grad, T* grad_in, T* dweight,
                     T* dbias, T* dprelu, double* work, cudaStream_t stream);

}  // namespace medseg::cuda
#endif
