"""Sharded safetensors directories: validated reading (headers, memory-mapped tensors) and writing.

Reading never unpickles and never materializes the whole checkpoint: headers are parsed as JSON
(to learn names, dtypes and shapes, and to catch truncated shards), and only the requested
tensors are read through ``safetensors.safe_open`` (a memory map).

Writing (:func:`write_sharded_checkpoint`) is used by the synthetic checkpoints and by tests that
plant defects.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4mtp.errors import CheckpointError, ConfigError

__all__ = [
    "INDEX_FILE",
    "SAFETENSORS_DTYPES",
    "ShardedCheckpoint",
    "TensorInfo",
    "check_checkpoint_dir",
    "read_safetensors_header",
    "write_sharded_checkpoint",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def check_checkpoint_dir(path: str) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a directory (a checkpoint is one)."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise CheckpointError(
            f"{path}: is a file, expected the checkpoint directory (the one holding config.json "
            f"and the safetensors shards)"
        )
    raise CheckpointError(f"{path}: no such directory, expected the checkpoint directory")


@dataclass(frozen=True)
class TensorInfo:
    """What a shard header says about one tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: str


def _is_int_list(v: Any, length: int | None = None) -> bool:
    return (
        isinstance(v, list)
        and (length is None or len(v) == length)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    )


def _header_entry(shard: str, name: str, meta: Any) -> tuple[TensorInfo, int]:
    """One tensor's header entry, checked as far as the reader relies on it: (info, data end)."""
    where = f"{shard}: tensor {name}"
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{where}: header entry must be an object with dtype, shape and data_offsets, got "
            f"{type(meta).__name__}"
        )
    dtype_name: Any = meta.get("dtype")
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: unsupported dtype {dtype_name!r}")
    shape: Any = meta.get("shape")
    offsets: Any = meta.get("data_offsets")
    if not _is_int_list(shape):
        raise CheckpointError(
            f"{where}: header entry 'shape': expected a list of non-negative ints, got {shape!r}"
        )
    if not _is_int_list(offsets, 2) or offsets[0] > offsets[1]:
        raise CheckpointError(
            f"{where}: header entry 'data_offsets': expected [begin, end] with 0 <= begin <= "
            f"end, got {offsets!r}"
        )
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{where}: header says shape {tuple(shape)} of {str(dtype).removeprefix('torch.')} "
            f"({nbytes} bytes) but data_offsets {offsets} span {offsets[1] - offsets[0]} bytes"
        )
    return TensorInfo(name, dtype, tuple(shape), shard), offsets[1]


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Parse one shard's header (8-byte little-endian length + JSON) and check the file is whole.

    Raises :class:`CheckpointError` when the file is shorter than its header says.
    """
    shard = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{shard}: truncated safetensors file: the header length field needs 8 bytes, "
                f"file has {size}"
            )
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(
                f"{shard}: truncated safetensors file: header says {8 + n} bytes of header, "
                f"file has {size}"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{shard}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{shard}: corrupt safetensors header: expected a JSON object, got "
            f"{type(header).__name__}"
        )
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        info, end = _header_entry(shard, name, meta)
        out[name] = info
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{shard}: truncated safetensors file: header says {8 + n + data_end} bytes, "
            f"file has {size}"
        )
    return out


def _read_index(index_path: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name), checked for its types."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{INDEX_FILE}: not a valid safetensors index ({e!r})") from e
    if not isinstance(index, dict) or "weight_map" not in index:
        got = "no weight_map key" if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(
            f"{INDEX_FILE}: not a valid safetensors index: expected an object with a "
            f"'weight_map', got {got}"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{INDEX_FILE}: weight_map: expected an object mapping tensor names to shard file "
            f"names, got {type(weight_map).__name__}"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(
                f"{INDEX_FILE}: weight_map[{name!r}]: expected a shard file name, got {shard!r}"
            )
    return weight_map


def _shard_path(root: str, shard: str, example: str) -> str:
    """``root/shard``, refused unless it stays inside ``root`` (symlinks resolved)."""
    real_root = os.path.realpath(root)
    inside = False
    if "\x00" not in shard and not os.path.isabs(shard):
        real = os.path.realpath(os.path.join(root, shard))
        inside = real != real_root and os.path.commonpath([real, real_root]) == real_root
    if not inside:
        raise CheckpointError(
            f"{INDEX_FILE}: weight_map[{example!r}] = {shard!r}: the shard path leads outside "
            f"the checkpoint directory {root}; expected a file inside it"
        )
    return os.path.join(root, shard)


class ShardedCheckpoint:
    """A checkpoint directory: ``model.safetensors.index.json`` + shards, or one ``model.safetensors``.

    Every shard the index lists is checked on open (present, header readable, not truncated) and
    every name of the index must be in its shard's header.  Tensors are read lazily by name.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        check_checkpoint_dir(self.path)
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index_path):
            weight_map = _read_index(index_path)
        elif os.path.exists(os.path.join(self.path, SINGLE_FILE)):
            weight_map = dict.fromkeys(
                read_safetensors_header(os.path.join(self.path, SINGLE_FILE)), SINGLE_FILE
            )
        else:
            raise CheckpointError(
                f"{self.path}: no {INDEX_FILE} or {SINGLE_FILE}: not a safetensors checkpoint"
            )
        self.infos: dict[str, TensorInfo] = {}
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            example = next(n for n, s in weight_map.items() if s == shard)
            shard_path = _shard_path(self.path, shard, example)
            if not os.path.isfile(shard_path):
                raise CheckpointError(
                    f"{shard}: listed in {INDEX_FILE} (e.g. for {example}) but missing from "
                    f"{self.path}"
                )
            headers[shard] = read_safetensors_header(shard_path)
        for name, shard in weight_map.items():
            info = headers[shard].get(name)
            if info is None:
                raise CheckpointError(f"{name}: {INDEX_FILE} says it is in {shard}, but it is not")
            self.infos[name] = info
        # Tensors of the indexed shards that the index does not list: invisible to a loader that
        # follows the index (as vLLM does), but worth naming when they are reported missing.
        self.unindexed: dict[str, str] = {
            name: shard
            for shard, header in headers.items()
            for name in header
            if name not in weight_map
        }
        self._handles: dict[str, Any] = {}

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def why_missing(self, name: str) -> str:
        """ " (in <shard>, but the index does not list it)" for an unindexed tensor, else ""."""
        shard = self.unindexed.get(name)
        return f" (in {shard}, but {INDEX_FILE} does not list it)" if shard else ""

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped shard; only this tensor's bytes are copied)."""
        info = self.infos[name]
        try:
            handle = self._handles.get(info.shard)
            if handle is None:
                handle = safe_open(os.path.join(self.path, info.shard), framework="pt")
                self._handles[info.shard] = handle
            return handle.get_tensor(name)
        except Exception as e:  # safetensors' own checks (e.g. overlapping data) beyond ours
            raise CheckpointError(f"{info.shard}: tensor {name}: cannot read it ({e})") from e

    def close(self) -> None:
        self._handles.clear()


def write_sharded_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    config_dict: Mapping[str, Any] | None,
    *,
    num_shards: int = 2,
    hf_quant_config: Mapping[str, Any] | None = None,
    shard_of: Mapping[str, int] | None = None,
) -> str:
    """Write ``tensors`` as ``num_shards`` safetensors files + index (+ config.json, + quant json).

    Tensors go to shards in their dict order, in contiguous runs of about equal count, unless
    ``shard_of`` places a name on a given shard (0-based).  ``config_dict=None`` writes no
    config.json (to test that error).  Returns the directory path.
    """
    path = os.fspath(path)
    if num_shards < 1:
        raise ConfigError(f"num_shards: expected >= 1, got {num_shards}")
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    per_shard = max(1, -(-len(names) // num_shards))
    files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    buckets: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for pos, name in enumerate(names):
        k = (shard_of or {}).get(name, min(pos // per_shard, num_shards - 1))
        buckets[k][name] = tensors[name].contiguous()
    weight_map: dict[str, str] = {}
    total = 0
    for k, bucket in enumerate(buckets):
        save_file(bucket, os.path.join(path, files[k]))
        for name, t in bucket.items():
            weight_map[name] = files[k]
            total += t.numel() * t.element_size()
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if config_dict is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(config_dict), f, indent=2)
    if hf_quant_config is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(dict(hf_quant_config), f, indent=2)
    return path
