"""Triton kernels, each beside its plain torch reference twin (same signature)."""
