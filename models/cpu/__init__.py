"""The CPU wing: C kernels applied to a loaded model by ``backend.CpuBackend.apply``."""
