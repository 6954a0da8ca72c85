"""dsv4-mtp: the DeepSeek-V4 MTP draft layer.

``dsv4mtp.reference`` is the readable, CPU-runnable PyTorch reference; ``dsv4mtp.optimized``
exposes the same public functions with H200 kernels (FlashInfer where it has sm_90 kernels,
Triton where it does not); ``dsv4mtp.conformance`` is the test suite of both.

Their sources are the repository's top-level reference/, optimized/ and conformance/ folders,
mapped under this package by the installed distribution (pyproject.toml says which installs
do that): a bare checkout on sys.path imports this folder only.
"""

__version__ = "0.1.0"
