"""Attention ops over the paged KV cache and the other fused ops of the model's forward: torch reference
code (the test oracle, and the CPU path where nothing faster applies) in ``reference``, C++ CPU kernels
(``csrc/``, compiled at install by ``build``, loaded by ``cpu_kernels``) and Triton kernels (the GPU
path) in ``triton_attention`` and ``triton_moe``.

Imports nothing but torch and triton (the bottom layer), and this file imports neither: choosing the
implementation is the caller's business.
"""
