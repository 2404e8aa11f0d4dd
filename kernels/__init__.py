"""medseg.kernels: fused memory-saving autograd functions for 3D networks (see DESIGN.md)."""
