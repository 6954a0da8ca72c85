"""dsv4-mtp: the DeepSeek-V4 MTP draft layer.

``dsv4mtp.reference`` is the readable, CPU-runnable PyTorch reference; ``dsv4mtp.optimized``
exposes the same public functions with H200 kernels (FlashInfer where it has sm_90 kernels,
Triton where it does not).
"""

__version__ = "0.1.0"
