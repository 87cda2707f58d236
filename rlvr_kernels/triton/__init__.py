"""Triton kernels (the CUDA backend), one module per op family.

Importing this package does not import Triton; the op modules do, when first used.
"""

# The GPU architectures of the ahead-of-time compile (``python -m rlvr_kernels.triton.aot``):
# sm_80 and sm_90. Here, not in ``aot``, so that the kernel modules' ``aot_specs()`` read it
# without importing the module that imports them.
AOT_ARCHS = (80, 90)
