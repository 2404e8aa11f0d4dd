// Fused Dice + cross-entropy loss: CPU kernels, the CUDA host glue, and the Python binding
// (registered into the norm_act extension module by register_dice_ce). Maths: kernels/dice_ce.py.
//
// A task is kLossChunk voxels of one sample. Each task walks its voxels in blocks of kBlock: per
// block it computes the per-voxel max and Σ exp over the C logits (class-outer, voxel-inner loops
// that vectorise), then p = exp(x − m) / Σ, and adds p into per-task double partials (I, P, G per
// class, the CE sum). Partials are combined in task order, so results do not depend on the thread
// count. Backward recomputes m, Σ and p the same way and writes dx; no full-size temporaries.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "dice_ce.h"

#ifdef MEDSEG_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace medseg {
namespace {

using at::Tensor;
constexpr int64_t kBlock = 256;

struct LossGeo {
  int64_t N, C, S;
  int64_t chunks() const { return (S + kLossChunk - 1) / kLossChunk; }
};

LossGeo check_loss_inputs(const Tensor& x, const Tensor& y) {
  TORCH_CHECK(x.dim() == 3, "medseg dice_ce: logits must be (N, C, S), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "medseg dice_ce: logits must be float32 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "medseg dice_ce: logits and labels must be contiguous");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == x.size(2),
              "medseg dice_ce: labels must be (N, S) = (", x.size(0), ", ", x.size(2), "), got ", y.sizes());
  TORCH_CHECK(y.scalar_type() == at::kByte || y.scalar_type() == at::kInt,
              "medseg dice_ce: labels must be uint8 or int32, got ", y.scalar_type());
  TORCH_CHECK(y.device() == x.device(), "medseg dice_ce: labels on ", y.device(), ", logits on ", x.device());
  TORCH_CHECK(x.size(1) >= 2, "medseg dice_ce: needs at least 2 classes");
#ifndef MEDSEG_WITH_CUDA
  TORCH_CHECK(!x.is_cuda(), "medseg dice_ce: the native kernels were built without CUDA support");
#endif
  return {x.size(0), x.size(1), x.size(2)};
}

// Per-voxel max and Σ exp(x − max) of a block of `len` voxels starting at s0.
template <typename T>
void block_softmax_denominator(const T* xn, int64_t C, int64_t S, int64_t s0, int64_t len, T* m, T* se) {
  for (int64_t i = 0; i < len; ++i) m[i] = xn[s0 + i];
  for (int64_t c = 1; c < C; ++c) {
    const T* xc = xn + c * S + s0;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) m[i] = xc[i] > m[i] ? xc[i] : m[i];
  }
  for (int64_t i = 0; i < len; ++i) se[i] = T(0);
  for (int64_t c = 0; c < C; ++c) {
    const T* xc = xn + c * S + s0;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) se[i] += std::exp(xc[i] - m[i]);
  }
}

template <typename T, typename L>
void forward_cpu(const T* x, const L* y, const LossGeo g, double* stats, double* ce) {
  const int64_t per = g.chunks(), tasks = g.N * per;
  const int64_t width = 3 * g.C + 2;  // I, P, G per class; CE sum; invalid labels
  std::vector<double> part(tasks * width, 0.0);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    T m[kBlock], se[kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t / per, lo = (t % per) * kLossChunk, hi = std::min(g.S, lo + kLossChunk);
      const T* xn = x + n * g.C * g.S;
      const L* yn = y + n * g.S;
      double* acc = part.data() + t * width;
      for (int64_t s0 = lo; s0 < hi; s0 += kBlock) {
        const int64_t len = std::min(kBlock, hi - s0);
        block_softmax_denominator(xn, g.C, g.S, s0, len, m, se);
        for (int64_t c = 0; c < g.C; ++c) {
          const T* xc = xn + c * g.S + s0;
          double sum_p = 0, sum_i = 0, count = 0;
#pragma omp simd reduction(+ : sum_p, sum_i, count)
          for (int64_t i = 0; i < len; ++i) {
            const double p = double(std::exp(xc[i] - m[i]) / se[i]);
            const bool hit = int64_t(yn[s0 + i]) == c;
            sum_p += p;
            sum_i += hit ? p : 0.0;
            count += hit ? 1.0 : 0.0;
          }
          acc[3 * c] += sum_i;
          acc[3 * c + 1] += sum_p;
          acc[3 * c + 2] += count;
        }
        for (int64_t i = 0; i < len; ++i) {
          const int64_t label = int64_t(yn[s0 + i]);
          if (label < 0 || label >= g.C) {
            acc[3 * g.C + 1] += 1;
            continue;
          }
          acc[3 * g.C] += double(m[i]) + std::log(double(se[i])) - double(xn[label * g.S + s0 + i]);
        }
      }
    }
  });
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t k = 0; k < per; ++k) {
      const double* acc = part.data() + (n * per + k) * width;
      for (int64_t j = 0; j < 3 * g.C; ++j) stats[n * 3 * g.C + j] += acc[j];
      ce[2 * n] += acc[3 * g.C];
      ce[2 * n + 1] += acc[3 * g.C + 1];
    }
}

template <typename T, typename L>
void backward_cpu(const T* x, const L* y, const LossGeo g, const double* a, const double* b, double e, T* dx) {
  const int64_t per = g.chunks();
  at::parallel_for(0, g.N * per, 1, [&](int64_t begin, int64_t end) {
    T m[kBlock], se[kBlock], dot[kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t / per, lo = (t % per) * kLossChunk, hi = std::min(g.S, lo + kLossChunk);
      const T* xn = x + n * g.C * g.S;
      const L* yn = y + n * g.S;
      T* dn = dx + n * g.C * g.S;
      const double* an = a + n * g.C;
      const double* bn = b + n * g.C;
      for (int64_t s0 = lo; s0 < hi; s0 += kBlock) {
        const int64_t len = std::min(kBlock, hi - s0);
        block_softmax_denominator(xn, g.C, g.S, s0, len, m, se);
        for (int64_t i = 0; i < len; ++i) dot[i] = T(0);
        for (int64_t c = 0; c < g.C; ++c) {  // Σ_k p_k g_k
          const T* xc = xn + c * g.S + s0;
          const T ac = T(an[c]), bc = T(bn[c]);
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) {
            const T p = std::exp(xc[i] - m[i]) / se[i];
            const T gc = int64_t(yn[s0 + i]) == c ? ac + bc : bc;
            dot[i] += p * gc;
          }
        }
        const T et = T(e);
        for (int64_t c = 0; c < g.C; ++c) {
          const T* xc = xn + c * g.S + s0;
          T* dc = dn + c * g.S + s0;
          const T ac = T(an[c]), bc = T(bn[c]);
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) {
            const T p = std::exp(xc[i] - m[i]) / se[i];
            const bool hit = int64_t(yn[s0 + i]) == c;
            const T gc = hit ? ac + bc : bc;
            dc[i] = p * (gc - dot[i]) + et * (p - (hit ? T(1) : T(0)));
          }
        }
      }
    }
  });
}

#ifdef MEDSEG_WITH_CUDA
// Variadic: the call inside has template arguments (<scalar_t, L>) whose comma would split it.
#define MEDSEG_LOSS_CUDA_CHECK(...)                                                                    \
  do {                                                                                               \
    const cudaError_t err_ = (__VA_ARGS__);                                                          \
    TORCH_CHECK(err_ == cudaSuccess, "medseg dice_ce CUDA kernel failed: ", cudaGetErrorString(err_)); \
  } while (0)
#endif

// Calls f.template operator()<L>() with L the label type.
template <typename F>
void dispatch_labels(const Tensor& y, const F& f) {
  if (y.scalar_type() == at::kByte)
    f(static_cast<const uint8_t*>(nullptr));
  else
    f(static_cast<const int32_t*>(nullptr));
}

std::tuple<Tensor, Tensor> dice_ce_forward(const Tensor& x, const Tensor& y) {
  const LossGeo g = check_loss_inputs(x, y);
  auto opts = x.options().dtype(at::kDouble);
  Tensor stats = at::zeros({g.N, g.C, 3}, opts), ce = at::zeros({g.N, 2}, opts);
  if (x.is_cuda()) {
#ifdef MEDSEG_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_dice_ce_forward_cuda", [&] {
      dispatch_labels(y, [&](auto tag) {
        using L = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        MEDSEG_LOSS_CUDA_CHECK(cuda::dice_ce_forward<scalar_t, L>(
            x.data_ptr<scalar_t>(), static_cast<const L*>(y.data_ptr()), g.N, g.C, g.S, stats.data_ptr<double>(),
            ce.data_ptr<double>(), c10::cuda::getCurrentCUDAStream().stream()));
      });
    });
#endif
  } else {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_dice_ce_forward_cpu", [&] {
      dispatch_labels(y, [&](auto tag) {
        using L = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        forward_cpu<scalar_t, L>(x.data_ptr<scalar_t>(), static_cast<const L*>(y.data_ptr()), g,
                                 stats.data_ptr<double>(), ce.data_ptr<double>());
      });
    });
  }
  // Column 1 of ce counts labels outside [0, C); callers check it without a host sync.
  return {stats, ce};
}

void dice_ce_backward(const Tensor& x, const Tensor& y, const Tensor& a, const Tensor& b, const Tensor& e,
                      const Tensor& grad_in) {
  const LossGeo g = check_loss_inputs(x, y);
  for (const Tensor* t : {&a, &b})
    TORCH_CHECK(t->scalar_type() == at::kDouble && t->is_contiguous() && t->numel() == g.N * g.C &&
                    t->device() == x.device(),
                "medseg dice_ce: a and b must be contiguous float64 (N, C) on the logits' device");
  TORCH_CHECK(e.scalar_type() == at::kDouble && e.numel() == 1 && e.device() == x.device(),
              "medseg dice_ce: e must be one float64 on the logits' device");
  TORCH_CHECK(grad_in.sizes() == x.sizes() && grad_in.scalar_type() == x.scalar_type() && grad_in.is_contiguous() &&
                  grad_in.device() == x.device(),
              "medseg dice_ce: grad_in must be a contiguous tensor like the logits");
  TORCH_CHECK(grad_in.data_ptr() != x.data_ptr(), "medseg dice_ce: grad_in must not alias the logits");
  if (x.is_cuda()) {
#ifdef MEDSEG_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_dice_ce_backward_cuda", [&] {
      dispatch_labels(y, [&](auto tag) {
        using L = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        MEDSEG_LOSS_CUDA_CHECK(cuda::dice_ce_backward<scalar_t, L>(
            x.data_ptr<scalar_t>(), static_cast<const L*>(y.data_ptr()), g.N, g.C, g.S, a.data_ptr<double>(),
            b.data_ptr<double>(), e.data_ptr<double>(), grad_in.data_ptr<scalar_t>(),
            c10::cuda::getCurrentCUDAStream().stream()));
      });
    });
#endif
    return;
  }
  const double ev = *e.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "medseg_dice_ce_backward_cpu", [&] {
    dispatch_labels(y, [&](auto tag) {
      using L = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      backward_cpu<scalar_t, L>(x.data_ptr<scalar_t>(), static_cast<const L*>(y.data_ptr()), g, a.data_ptr<double>(),
                                b.data_ptr<double>(), ev, grad_in.data_ptr<scalar_t>());
    });
  });
}

}  // namespace

void register_dice_ce(pybind11::module_& m) {
  namespace py = pybind11;
  using namespace pybind11::literals;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("dice_ce_forward", &dice_ce_forward,
        "(stats (N, C, 3) float64 [I, P, G], ce (N, 2) float64 [Σ CE, invalid labels]) of softmax(x)", "x"_a, "y"_a,
        nogil);
  m.def("dice_ce_backward", &dice_ce_backward,
        "Writes dx = p (g − Σ p g) + e (p − onehot), g = a onehot + b, into grad_in", "x"_a, "y"_a, "a"_a, "b"_a,
        "e"_a, "grad_in"_a, nogil);
}

}  // namespace medseg
