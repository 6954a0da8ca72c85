"""dsv4-mtp: the DeepSeek-V4 MTP draft layer.

``dsv4mtp.reference`` is the readable, CPU-runnable PyTorch reference; ``dsv4mtp.optimized``
exposes the same public functions with H200 kernels (FlashInfer where it has sm_90 kernels,
Triton where it does not).
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The sources of dsv4mtp.reference / dsv4mtp.optimized are the top-level folders reference/ and
# optimized/ of the repository.  Wheels and PEP 660 editable installs map them into place; a
# source checkout on PYTHONPATH, or a legacy `setup.py develop` install (old setuptools, as on
# the GPU machine), finds only this folder, so let it look beside itself as well.
_repo = _Path(__file__).resolve().parent.parent
if (_repo / "reference" / "mhc.py").is_file() and (_repo / "optimized").is_dir():
    __path__.append(str(_repo))
