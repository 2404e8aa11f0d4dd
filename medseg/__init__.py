"""medseg: MONAI 3D segmentation and classification, trained across hospital GPUs, served in a viewer."""

__version__ = "0.1.0"
