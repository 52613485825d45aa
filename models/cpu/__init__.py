"""The CPU wing: C kernels for attention, matmuls, row ops and whole decode steps, applied to a
loaded model by ``backend.CpuBackend.apply``."""
