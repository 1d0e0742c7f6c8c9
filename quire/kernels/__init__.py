"""Triton kernels for the GPU attention path over the paged KV cache."""
