"""Triton kernels (the CUDA backend), one module per op family.

Importing this package does not import Triton; the op modules do, when first used.
"""
