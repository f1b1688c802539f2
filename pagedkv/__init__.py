"""pagedkv: a correct, fast, inspectable paged KV-cache index layer.

The control plane (``pagedkv.core``) is pure Python + numpy; the data plane
(``pagedkv.worker``, ``pagedkv.kernels``) uses torch and Triton.
"""

__version__ = "0.1.0"
