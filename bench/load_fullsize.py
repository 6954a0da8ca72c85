"""Load time and memory of ``MTPLayer.from_checkpoint`` on a real-size random checkpoint.

Writes (or, with ``--reuse``, reuses) a checkpoint of :mod:`dsv4mtp.checkpoint.fullsize`
(``dsv4-mtp make-checkpoint``), then loads it once per implementation and page-cache state, each
load in a fresh Python process so that its peak RSS is the load's alone:

* load time: wall time of ``from_checkpoint`` (headers, value scan, reads, expert stacking, dense
  dequantization, copy to the device), CUDA synchronized;
* host memory: RSS before the load (torch imported, CUDA context made), peak RSS of the process
  (``getrusage`` ru_maxrss) and RSS after;
* GPU memory (CUDA): ``torch.cuda.max_memory_allocated`` during the load and
  ``memory_allocated`` after it (what the layer keeps);
* optionally (``--forward-tokens T``) one k=1 draft of T tokens, its time and whether every
  logit is finite.

Page cache: ``cold`` evicts the shards first (fsync + ``posix_fadvise(DONTNEED)``, best effort:
no root needed, pages other processes hold may stay), ``warm`` reads them once before loading.
The writer's own wall time and peak memory are reported too (the parent process does nothing
else heavy).

Implementations: ``reference`` (``dsv4mtp.reference.MTPLayer``); ``optimized`` joins
:data:`IMPLEMENTATIONS` when ``dsv4mtp.optimized`` has an ``MTPLayer`` with ``from_checkpoint``.

    python bench/load_fullsize.py --config flash --expert-format mxfp4 --device cuda \\
        --dir /tmp/v4flash-mxfp4 --reuse --forward-tokens 16
    python bench/load_fullsize.py --config tiny --device cpu          # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

_GIB = 1 << 30


def _rss_bytes() -> int:
    """Current resident set size of this process (/proc; 0 where it does not exist)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


# ----------------------------------------------------------------------------- implementations
def _reference_builder() -> Callable[..., Any]:
    from dsv4mtp.reference import MTPLayer

    return MTPLayer.from_checkpoint


def _optimized_builder() -> Callable[..., Any]:
    import dsv4mtp.optimized as optimized

    cls = getattr(optimized, "MTPLayer", None)
    if cls is None or not hasattr(cls, "from_checkpoint"):
        raise SystemExit("--impl optimized: dsv4mtp.optimized has no MTPLayer.from_checkpoint yet")
    return cls.from_checkpoint


# name -> builder of ``from_checkpoint(path, *, dtype, device)``; imported only in the child.
IMPLEMENTATIONS: dict[str, Callable[[], Callable[..., Any]]] = {
    "reference": _reference_builder,
    "optimized": _optimized_builder,
}


# ----------------------------------------------------------------------------- child: one load
def _child(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    build = IMPLEMENTATIONS[args["impl"]]()
    device = torch.device(args["device"])
    dtype = getattr(torch, args["dtype"])
    cuda = device.type == "cuda"
    if cuda:
        torch.zeros(1, device=device)  # the context, outside the measurement
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    layer = build(args["path"], dtype=dtype, device=device)
    if cuda:
        torch.cuda.synchronize(device)
    out: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "rss_before": rss_before,
        "rss_peak": _peak_rss_bytes(),
        "rss_after": _rss_bytes(),
    }
    if cuda:
        out["gpu_peak"] = torch.cuda.max_memory_allocated(device)
        out["gpu_after"] = torch.cuda.memory_allocated(device)
    T = args["forward_tokens"]
    if T:
        cfg = layer.config
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)
        pos = torch.arange(T).to(device)
        prev = torch.randn(T, cfg.hc_mult * cfg.hidden_size, generator=g).to(device, dtype)
        t0 = time.perf_counter()
        _, logits = layer.draft(ids, pos, prev, num_tokens=1, return_logits=True)
        if cuda:
            torch.cuda.synchronize(device)
        out["forward_s"] = time.perf_counter() - t0
        out["forward_finite"] = bool(torch.isfinite(logits).all())
        if cuda:
            out["gpu_peak_forward"] = torch.cuda.max_memory_allocated(device)
    return out


# ----------------------------------------------------------------------------- parent
def _shards(path: str) -> list[str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(path, s) for s in files]


def _set_page_cache(path: str, state: str) -> None:
    for shard in _shards(path):
        if state == "cold":
            fd = os.open(shard, os.O_RDONLY)
            try:
                os.fsync(fd)  # DONTNEED drops clean pages only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        else:
            with open(shard, "rb") as f:
                while f.read(64 << 20):
                    pass


def _prepare(a: argparse.Namespace) -> tuple[str, dict[str, Any], bool]:
    """(checkpoint dir, writer facts, whether to delete it at the end)."""
    from dsv4mtp.checkpoint.fullsize import GENERATOR, GENERATOR_FILE, make_fullsize_checkpoint

    path, cleanup = a.dir, False
    if path is None:
        path, cleanup = tempfile.mkdtemp(prefix="dsv4-fullsize-", dir=a.tmp), not a.keep
    index = os.path.join(path, "model.safetensors.index.json")
    if a.reuse and os.path.exists(index):
        with open(os.path.join(path, GENERATOR_FILE)) as f:
            meta = json.load(f)
        want = {"generator": GENERATOR, "config": a.config, "expert_format": a.expert_format}
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise SystemExit(f"--reuse: {path} was written with {got}, expected {want}")
        total = sum(os.path.getsize(s) for s in _shards(path))
        return path, {"reused": True, "bytes": total, "shards": len(_shards(path))}, cleanup
    import torch

    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report = make_fullsize_checkpoint(
        path,
        a.config,
        expert_format=a.expert_format,
        device=a.device,
        shard_mb=a.shard_mb,
        seed=a.seed,
        progress=lambda line: print(line, file=sys.stderr),
    )
    facts = {
        "reused": False,
        "bytes": report.total_bytes,
        "shards": len(report.shards),
        "write_wall_s": report.wall_s,
        "write_draw_s": report.draw_s,
        "write_save_s": report.write_s,
        "write_rss_peak": _peak_rss_bytes(),
        "write_gpu_peak": torch.cuda.max_memory_allocated() if cuda else None,
    }
    return path, facts, cleanup


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _table(a: argparse.Namespace, facts: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"`{' '.join(sys.argv)}`",
        "",
        f"checkpoint: config {a.config}, experts {a.expert_format}, {facts['bytes']} bytes "
        f"({_gb(facts['bytes'])} GB) in {facts['shards']} shard(s), "
        + (
            "reused"
            if facts["reused"]
            else f"written on {a.device} in {facts['write_wall_s']:.1f} s (draw "
            f"{facts['write_draw_s']:.1f} s, save {facts['write_save_s']:.1f} s), writer peak "
            f"RSS {_gb(facts['write_rss_peak'])} GB, writer GPU peak "
            f"{_gb(facts['write_gpu_peak'])} GB"
        ),
        "",
        "| impl | page cache | device | dtype | load s | RSS before GB | RSS peak GB | RSS after "
        "GB | GPU peak GB | GPU after GB | forward T | forward s | finite |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["m"]
        fwd = "-" if "forward_s" not in m else f"{m['forward_s']:.2f}"
        lines.append(
            f"| {r['impl']} | {r['cache']} | {a.device} | {a.dtype} | {m['load_s']:.2f} | "
            f"{_gb(m['rss_before'])} | {_gb(m['rss_peak'])} | {_gb(m['rss_after'])} | "
            f"{_gb(m.get('gpu_peak'))} | {_gb(m.get('gpu_after'))} | {a.forward_tokens or '-'} | "
            f"{fwd} | {m.get('forward_finite', '-')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="flash", help="flash, pro, tiny or a config.json path")
    p.add_argument("--expert-format", default="mxfp4", choices=["mxfp4", "nvfp4", "fp8"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--reuse", action="store_true", help="use --dir if it holds a checkpoint")
    p.add_argument("--keep", action="store_true", help="keep the temp checkpoint")
    p.add_argument("--tmp", default=None, help="parent of the temp dir (default: $TMPDIR)")
    p.add_argument("--shard-mb", type=float, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="reference", help=f"comma list of {list(IMPLEMENTATIONS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    p.add_argument("--cache", default="cold,warm", help="comma list of cold, warm")
    p.add_argument("--forward-tokens", type=int, default=0, help="T of one k=1 draft (0: none)")
    p.add_argument("--json", default=None, help="also write the measurements to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(_child(json.loads(a.child))))
        return
    impls = [s for s in a.impl.split(",") if s]
    caches = [s for s in a.cache.split(",") if s]
    if not set(impls) <= set(IMPLEMENTATIONS) or not set(caches) <= {"cold", "warm"}:
        p.error(f"--impl from {list(IMPLEMENTATIONS)}, --cache from cold, warm")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    from dsv4mtp.errors import DSV4Error

    try:
        path, facts, cleanup = _prepare(a)
    except DSV4Error as e:  # a bad argument: one line, as the CLI prints it
        raise SystemExit(f"Error: {e}") from e
    rows = []
    try:
        for impl in impls:
            for cache in caches:
                _set_page_cache(path, cache)
                child = {
                    "impl": impl,
                    "path": path,
                    "device": a.device,
                    "dtype": a.dtype,
                    "forward_tokens": a.forward_tokens,
                }
                cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(child)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    raise SystemExit(f"{impl} ({cache}) failed:\n{res.stderr[-4000:]}")
                rows.append(
                    {"impl": impl, "cache": cache, "m": json.loads(res.stdout.splitlines()[-1])}
                )
        table = _table(a, facts, rows)
        print(table)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "checkpoint": facts, "rows": rows}, f, indent=2)
    finally:
        if cleanup:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
