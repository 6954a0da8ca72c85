"""H200 diagnostic of the optimized MoE kernels: correctness at V4-Flash shapes and CUDA-graph
times against the bytes each call must touch.

Plain command on the GPU machine (repo root): ``python3 bench/diag/moe_kernels_h200.py``.
Weights are random codes in each format (E 256, top-6, I 2048, D 4096), routing from the
optimized router on random x (uniform-ish).  Correctness: fused_experts against a torch fp32
computation over ``MoEPack.decode_expert`` (tolerance: bf16 rounding), moe against that plus the
shared expert, batch invariance (bitwise) and CUDA-graph replay (bitwise).  Times: graph replay
(triton.testing.do_bench_cudagraph), weights not rotated (at T >= 8 the touched experts exceed
the 50 MB L2 many times over; at T = 1 the 6 experts are 80 MB).  floor = touched bytes / copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import time

import torch
import triton.testing

from dsv4mtp import formats
from dsv4mtp.checkpoint.weights import QuantizedWeight, RoutedExperts
from dsv4mtp.config import DSV4Config
from dsv4mtp.optimized import fused_experts, moe, pack_moe, route
from dsv4mtp.params import MoEParams

dev = torch.device("cuda")
cfg = DSV4Config()  # V4-Flash
E, K, I, D = (
    cfg.n_routed_experts,
    cfg.num_experts_per_tok,
    cfg.moe_intermediate_size,
    cfg.hidden_size,
)
L = cfg.swiglu_limit
gen = torch.Generator(device=dev).manual_seed(0)


def rbytes(*shape, lo=0, hi=256):
    return torch.randint(lo, hi, shape, generator=gen, device=dev, dtype=torch.int32).to(
        torch.uint8
    )


def experts(fmt: str, e: int) -> RoutedExperts:
    kw = dict(
        num_experts=e, expert_start=0, num_local_experts=e, hidden_size=D, intermediate_size=I
    )
    if fmt == "mxfp4":
        return RoutedExperts(
            "mxfp4",
            rbytes(e, 2 * I, D // 2),
            rbytes(e, 2 * I, D // 32, lo=118, hi=124),
            rbytes(e, D, I // 2),
            rbytes(e, D, I // 32, lo=118, hi=124),
            **kw,
        )
    if fmt == "nvfp4":

        def sc(*s):
            return (torch.rand(*s, generator=gen, device=dev) * 2 + 0.25).to(torch.float8_e4m3fn)

        return RoutedExperts(
            "nvfp4",
            rbytes(e, 2 * I, D // 2),
            sc(e, 2 * I, D // 16),
            rbytes(e, D, I // 2),
            sc(e, D, I // 16),
            **kw,
            w13_weight_scale_2=torch.rand(e, 2, generator=gen, device=dev) * 0.01 + 0.005,
            w2_weight_scale_2=torch.rand(e, generator=gen, device=dev) * 0.01 + 0.005,
        )
    if fmt == "fp8":
        w13 = rbytes(e, 2 * I, D) & 0xF7  # avoid 0x7F/0xFF NaN bytes
        w2 = rbytes(e, D, I) & 0xF7

        def s(*sh):
            return torch.rand(*sh, generator=gen, device=dev) * 1e-3 + 1e-4

        return RoutedExperts(
            "fp8_f32",
            w13.view(torch.float8_e4m3fn),
            s(e, 2 * I // 128, D // 128),
            w2.view(torch.float8_e4m3fn),
            s(e, D // 128, I // 128),
            **kw,
        )
    raise ValueError(fmt)


def shared_fp8():
    out = []
    for shape in ((I, D), (I, D), (D, I)):
        q = (rbytes(*shape) & 0xF7).view(torch.float8_e4m3fn)
        s = (
            torch.randint(116, 120, (shape[0] // 128, shape[1] // 128), generator=gen, device=dev)
        ).to(torch.uint8)
        out.append(QuantizedWeight("fp8_e8m0", q, s, shape))
    return tuple(out)


def params_for(fmt: str, e: int) -> MoEParams:
    sq = shared_fp8()
    dense = [q.dequantize(torch.bfloat16) for q in sq]
    gate = (torch.randn(E, D, generator=gen, device=dev) * 0.02).bfloat16().float()
    bias = torch.randn(E, generator=gen, device=dev) * 0.01
    return MoEParams(gate, bias, dense[0], dense[1], dense[2], experts(fmt, e), shared_fp8=sq)


def ref_fused(x, pack, ids, w, limit):
    out = torch.zeros(x.shape, dtype=torch.float32, device=dev)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        w13, w2 = pack.decode_expert(e)
        gs = pack.gscale[e]
        xf = x[rows].float()
        g = (xf @ w13[:I].float().T * gs[0]).bfloat16().float()
        u = (xf @ w13[I:].float().T * gs[1]).bfloat16().float()
        u, g = u.clamp(-limit, limit), g.clamp(max=limit)
        h = (torch.nn.functional.silu(g) * u * w[rows, slots].float()[:, None]).bfloat16()
        y = (h.float() @ w2.float().T * gs[2]).bfloat16()
        out.index_add_(0, rows, y.float())
    return out


def ref_shared(x, pack, limit):
    w13 = formats.dequantize_fp8_block(
        pack.shared_w13[0].view(torch.float8_e4m3fn), pack.shared_s13[0]
    )
    w2 = formats.dequantize_fp8_block(
        pack.shared_w2[0].view(torch.float8_e4m3fn), pack.shared_s2[0]
    )
    g = (x.float() @ w13[:I].T).bfloat16().float()
    u = (x.float() @ w13[I:].T).bfloat16().float()
    u, g = u.clamp(-limit, limit), g.clamp(max=limit)
    h = (torch.nn.functional.silu(g) * u).bfloat16()
    return (h.float() @ w2.T).bfloat16().float()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def copy_bw():
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() * 2 / (ms * 1e-3)


def expert_bytes(pack):
    def per(t):
        return t[0].numel() * t.element_size() if t.numel() else 0

    return per(pack.w13) + per(pack.s13) + per(pack.w2) + per(pack.s2)


def main():
    t_start = time.time()
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = []
    for fmt in ("mxfp4", "nvfp4", "fp8"):
        t0 = time.time()
        p = params_for(fmt, E)
        pack = pack_moe(p, dev, max_tokens=4096)
        eb = expert_bytes(pack)
        sb = sum(
            t.numel() * t.element_size()
            for t in (pack.shared_w13, pack.shared_s13, pack.shared_w2, pack.shared_s2)
        )
        gb = pack.gate_weight.numel() * pack.gate_weight.element_size()
        # correctness at T = 8 and 64
        for T in (8, 64):
            x = torch.randn(T, D, generator=gen, device=dev).bfloat16()
            w, ids = route(x, pack.gate_weight, pack.gate_bias, cfg)
            ids2 = ids.clone()
            ids2[0, 0] = -1
            got = fused_experts(x, pack, ids2, w, limit=L).float()
            ref = ref_fused(x, pack, ids2, w, L)
            m = moe(x, pack, cfg).float()
            mref = (ref_fused(x, pack, ids, w, L) + ref_shared(x, pack, L)).bfloat16().float()
            print(
                f"{fmt} T={T}: fused rel {rel(got, ref):.2e}  moe rel {rel(m, mref):.2e}  nan {bool(got.isnan().any())}"
            )
        # batch invariance and graph replay
        x = torch.randn(64, D, generator=gen, device=dev).bfloat16()
        full = moe(x, pack, cfg, batch_invariant=True)
        one = moe(x[5:6].clone(), pack, cfg, batch_invariant=True)
        print(f"{fmt} batch_invariant row 5 bitwise: {torch.equal(full[5:6], one)}")
        xs = x[:8].clone()
        eager = moe(xs, pack, cfg)
        out = torch.empty_like(eager)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            moe(xs, pack, cfg, out=out)
        g.replay()
        torch.cuda.synchronize()
        print(f"{fmt} graph replay == eager: {torch.equal(out, eager)}")
        for T in (1, 8, 64, 512, 4096):
            if time.time() - t_start > 420:
                print("time cap reached")
                break
            x = torch.randn(T, D, generator=gen, device=dev).bfloat16()
            w, ids = route(x, pack.gate_weight, pack.gate_bias, cfg)
            n_exp = int(torch.unique(ids).numel())
            touched = n_exp * eb
            out = torch.empty_like(x)
            ms_fe = triton.testing.do_bench_cudagraph(
                lambda x=x, pack=pack, ids=ids, w=w, out=out: fused_experts(
                    x, pack, ids, w, limit=L, out=out
                ),
                rep=100,
            )
            ms_moe = triton.testing.do_bench_cudagraph(
                lambda x=x, pack=pack, out=out: moe(x, pack, cfg, out=out), rep=100
            )
            floor_fe = touched / bw * 1e6
            floor_moe = (touched + sb + gb + 2 * x.numel() * 2) / bw * 1e6
            rows.append((fmt, T, n_exp, ms_fe * 1e3, floor_fe, ms_moe * 1e3, floor_moe))
            print(
                f"{fmt} T={T:5d} experts {n_exp:3d}: fused {ms_fe * 1e3:8.1f} us (floor {floor_fe:7.1f}, x{ms_fe * 1e3 / floor_fe:5.2f})"
                f"  moe {ms_moe * 1e3:8.1f} us (floor {floor_moe:7.1f}, x{ms_moe * 1e3 / floor_moe:5.2f})",
                flush=True,
            )
        torch.cuda.empty_cache()
        print(f"{fmt} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
