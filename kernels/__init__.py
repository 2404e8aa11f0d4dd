"""medseg.kernels: fused memory-saving norm + activation for 3D networks (see docs/design.md).

``optimize_memory(model)`` rewrites MONAI UNet / SegResNet / DynUNet in place; the autograd layer is
``functions``, the maths ``reference``, the native CPU/CUDA backends ``native`` behind ``dispatch``.
"""

from medseg.kernels.convert import MemoryReport, optimize_memory

__all__ = ["MemoryReport", "optimize_memory"]
