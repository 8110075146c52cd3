"""The Triton launcher for the host code in kernels/pipeline.py over every 8-bit kernel by name:
the attention, the pre-pass and the k-means kernels (JIT-compiled, or interpreted under
TRITON_INTERPRET=1). The kernel modules launch their own through pipeline.jit_launcher; this one is
for callers that run the whole host pipeline with any of them (the Hopper kernel's pre-pass, tests,
benchmarks)."""

from .. import pipeline
from . import attention, kmeans, prepass

triton_launch = pipeline.jit_launcher(vars(attention), vars(prepass), vars(kmeans))
