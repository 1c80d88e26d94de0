"""Attention ops over the paged KV cache: torch reference code (the CPU path and the test
oracle) in ``reference`` and Triton kernels (the GPU path) in ``triton_attention``.

Imports nothing but torch and triton (the bottom layer), and this file imports neither: choosing the
implementation is the caller's business.
"""
