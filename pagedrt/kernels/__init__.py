"""CUDA kernels (``cuda_src/``) behind thin launchers, each beside its NumPy float64 reference twin."""
