// Fused Dice + cross-entropy loss (softmax, integer labels): shared declarations. The maths is in
// kernels/loss.py's docstring. Plain C++ so that dice_ce_cuda.cu compiles with bare nvcc.
#pragma once

#include <cstdint>

namespace medseg {

// Logits: contiguous (N, C, S). Labels: contiguous (N, S), uint8 or int32 (L).
// forward writes stats[(n*C + c)*3 + {0,1,2}] = (I, P, G) and ce[n*2 + {0,1}] = (Σ_s CE, number of
// labels outside [0, C)); both double, zeroed by the caller. backward writes dx into grad_in
// (may not alias x): dx_c = p_c (g_c − Σ_k p_k g_k) + e (p_c − [y = c]), g_c = a[n,c] [y = c] + b[n,c].
constexpr int64_t kLossChunk = 4096;  // voxels per task; fixed, so results do not depend on threads

}  // namespace medseg

#if defined(MEDSEG_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace medseg::cuda {

template <typename T, typename L>
cudaError_t dice_ce_forward(const T* x, const L* y, int64_t N, int64_t C, int64_t S, double* stats, double* ce,
                            cudaStream_t stream);

template <typename T, typename L>
cudaError_t dice_ce_backward(const T* x, const L* y, int64_t N, int64_t C, int64_t S, const double* a,
                             const double* b, const double* e, T* grad_in, cudaStream_t stream);

}  // namespace medseg::cuda
#endif
