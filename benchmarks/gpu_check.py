"""GPU check: every CUDA path of moebalance against its CPU reference, in one unattended run.

    python benchmarks/gpu_check.py                  # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --device cpu     # the same checks that also run on a CPU

Needs torch with CUDA, CuPy and Numba; no network. Sized to finish in a few minutes on one
H100/H200. On fresh random inputs (seeded) it checks:

1. ``kernels``: the ``csrc/`` dispatch kernels through CuPy (route, sort_by_slot, gather_rows
   plain and scaled, combine plain and weighted, combine_weight_grad) against the torch
   reference run on the CPU, float32/float64/bfloat16/float16, small and model-sized shapes.
2. ``experts``: the local slots' SwiGLU through ``torch._grouped_mm`` against the slot loop,
   forward and backward (bfloat16 on the GPU; float32 falls back to the loop there).
3. ``moe``: ``ExpertParallelMoE`` at world size 1 on the GPU (with and without the per-step
   re-split) against ``DenseMoE`` on the CPU, outputs and every gradient, float32.
4. ``no sync``: ``LoadTracker.record``, the routing flows and the re-split under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises.
   ``re-split``: ``csrc/resplit.cu`` through CuPy against the Numba re-split kernel, on
   placements for 256 experts on 64 devices x 8 slots, and its time per layer.
5. ``bandwidth``: GB/s of the CUDA gather_rows (permute) and combine kernels against the device's
   own copy bandwidth (``copy_`` of the same bytes), float32 and bfloat16, by the dispatch
   benchmark's GPU section; target >= 80%.

Without a CUDA GPU (and ``--device cuda``) it says so and exits 0 having checked nothing. It
prints a table last and writes JSON (``--out``). Exit status 1 when any check fails.

Legend: T tokens, K top-k, E experts, S slots, D hidden size, F expert hidden size, N = T*K.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

# (T, K, E, S, D): small odd shapes, then model-sized ones.
KERNEL_SHAPES = [(1, 1, 3, 3, 5), (37, 8, 16, 24, 33), (513, 6, 32, 40, 7),
                 (4096, 8, 64, 96, 1024), (300, 2, 4, 4, 7168)]
QUICK_KERNEL_SHAPES = KERNEL_SHAPES[:3]
BANDWIDTH_TARGET = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=(
        "Check every CUDA path of moebalance against its CPU reference and measure the dispatch "
        "kernels' bandwidth against the device's copy bandwidth."))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): the full check; cpu: the checks that have a CPU "
                             "form (Numba kernels, grouped GEMM, ExpertParallelMoE)")
    parser.add_argument("--quick", action="store_true", help="small shapes only, no bandwidth")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--out", default="gpu_check.json", metavar="FILE",
                        help="where to write the JSON results (default gpu_check.json)")
    return parser.parse_args(argv)


class Results:
    """Checks (name, ok, detail, seconds) and measured figures, printed as one table."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.figures: list[dict] = []

    def run(self, name: str, fn, *args) -> None:
        """Run ``fn(*args)``; it returns a detail string or raises (a failure)."""
        start = time.perf_counter()
        try:
            detail, ok = fn(*args), True
        except Exception as exc:  # every failure is recorded and the run goes on
            detail, ok = f"{type(exc).__name__}: {exc}", False
            traceback.print_exc()
        seconds = time.perf_counter() - start
        self.checks.append({"check": name, "ok": ok, "detail": str(detail),
                            "seconds": round(seconds, 2)})
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({seconds:.1f} s): {detail}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not c["ok"] for c in self.checks)

    def table(self) -> str:
        lines = [f"{'check':<44} {'result':<6} {'s':>6}  detail"]
        lines += [f"{c['check']:<44} {'PASS' if c['ok'] else 'FAIL':<6} {c['seconds']:>6.1f}  "
                  f"{c['detail'][:90]}" for c in self.checks]
        if self.figures:
            lines += ["", f"{'figure':<44} {'value':>10}  {'vs copy':>8}  target"]
            lines += [f"{f['name']:<44} {f['gbps']:>8.1f} GB/s {f['vs_copy']:>7.2f}x  "
                      f"{f['target']}" for f in self.figures]
        return "\n".join(lines)


# -- 1. dispatch kernels ------------------------------------------------------------------------


def kernel_inputs(shape, seed: int, dtype):
    """Random routed pairs of one shape: ids, route arguments, rows, weights (CPU tensors)."""
    from moebalance import Placement
    from moebalance.dispatch import reference
    from moebalance.dispatch.routing import replica_flows, replica_table

    T, K, E, S, D = shape
    gen = np.random.default_rng(seed)
    # Device 0 holds every expert once; the other slots form devices of at most E slots, each
    # holding distinct experts: a valid placement with replicas spread over devices.
    sizes = [E] + [min(E, S - E - i) for i in range(0, S - E, E)]
    device = np.repeat(np.arange(len(sizes)), sizes)
    phy2log = np.concatenate([gen.permutation(E)[:n] for n in sizes])
    G = len(sizes)
    weight = gen.random(S) + 0.1
    share = weight / np.bincount(phy2log, weights=weight, minlength=E)[phy2log]
    placement = Placement(phy2log[None], share[None], device, E).validate()
    table = replica_table(placement, 0)
    ids = torch.from_numpy(np.stack([gen.choice(E, K, replace=K > E) for _ in range(T)]))
    counts = torch.from_numpy(gen.integers(0, 50, (G, E)))
    rank = int(gen.integers(G))
    _, place, counts[rank] = reference.sort_by_slot(ids, E)
    flow = replica_flows(counts, table.share_EX, table.device_EX)
    rank_TK = place - (torch.cumsum(counts[rank], 0) - counts[rank])[ids]
    route_args = (rank_TK, table.slots_EX, torch.cumsum(flow[rank], dim=1))
    gen_t = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen_t).to(dtype)
    w = torch.rand(T, K, generator=gen_t).to(dtype)
    return ids, route_args, x, w


def check_kernels(device: str, shapes, seed: int) -> str:
    """The device's dispatch kernels equal the torch reference (run on the CPU)."""
    from moebalance.dispatch import reference

    if device == "cuda":
        from moebalance.dispatch import cuda as kernels
    else:
        from moebalance.dispatch import numba_kernels as kernels
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    checked = 0
    for i, shape in enumerate(shapes):
        T, K, E, S, D = shape
        for dtype in dtypes:
            ids, route_args, x, w = kernel_inputs(shape, seed + i, dtype)
            on = lambda t: t.to(device)  # noqa: E731
            slot = reference.route(ids, *route_args)
            _expect_equal(kernels.route(on(ids), *map(on, route_args)), slot, "route", shape)
            want = reference.sort_by_slot(slot, S)
            for got, ref, what in zip(kernels.sort_by_slot(on(slot), S), want,
                                      ("order_N", "pos_TK", "counts_S")):
                _expect_equal(got, ref, f"sort_by_slot {what}", shape)
            order, pos, _ = want
            index = order // K
            scale = w.reshape(-1)[order]
            _expect_equal(kernels.gather_rows(on(x), on(index)), reference.gather_rows(x, index),
                          f"gather_rows {dtype}", shape)
            _expect_equal(kernels.gather_rows(on(x), on(index), on(scale)),
                          reference.gather_rows(x, index, scale),
                          f"gather_rows scaled {dtype}", shape)
            y = torch.randn(T * K, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
            _expect_equal(kernels.combine(on(y), on(pos)), reference.combine(y, pos),
                          f"combine {dtype}", shape)
            _expect_equal(kernels.combine(on(y), on(pos), on(w)), reference.combine(y, pos, w),
                          f"combine weighted {dtype}", shape)
            tol = {torch.float64: 1e-12}.get(dtype, 1e-4)
            torch.testing.assert_close(kernels.combine_weight_grad(on(x), on(y), on(pos)).cpu(),
                                       reference.combine_weight_grad(x, y, pos),
                                       rtol=tol, atol=tol * D)
            checked += 1
    return f"{checked} (shape, dtype) cases, 7 kernels each, equal to the reference"


def _expect_equal(got: torch.Tensor, want: torch.Tensor, what: str, shape) -> None:
    if not torch.equal(got.cpu(), want):
        raise AssertionError(f"{what} differs from the reference at shape {shape}")


# -- 2. grouped-GEMM experts --------------------------------------------------------------------


def check_experts(device: str, seed: int) -> str:
    """Grouped-GEMM SwiGLU equals the slot loop, forward and backward."""
    from moebalance.nn import grouped_mm_runs, grouped_swiglu, looped_swiglu

    gen = torch.Generator().manual_seed(seed)
    ran = []
    dtypes = (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        for slots in (8, 16):
            D, F, M = 256, 128, 2048
            counts = torch.multinomial(torch.ones(slots), M, replacement=True,
                                       generator=gen).bincount(minlength=slots)
            counts[1] = 0
            counts = counts.tolist()
            rows = sum(counts)
            base = [torch.randn(rows, D, generator=gen), torch.randn(slots, 2 * F, D, generator=gen)
                    * D ** -0.5, torch.randn(slots, D, F, generator=gen) * F ** -0.5]
            proj = torch.randn(rows, D, generator=gen)
            results = {}
            for name, fn in (("grouped", grouped_swiglu), ("loop", looped_swiglu)):
                x, gu, dn = (t.to(device, dtype).requires_grad_() for t in base)
                if name == "grouped" and not grouped_mm_runs(x, F):
                    break
                y = fn(x, gu, dn, counts)
                y.backward(proj.to(device, dtype))
                results[name] = [t.float().cpu() for t in (y.detach(), x.grad, gu.grad, dn.grad)]
            if "grouped" not in results:
                ran.append(f"{slots} slots {dtype}: grouped_mm does not run here (loop)")
                continue
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            for got, want in zip(results["grouped"], results["loop"]):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            ran.append(f"{slots} slots {str(dtype).replace('torch.', '')} ok")
    return "; ".join(ran)


# -- 3. ExpertParallelMoE on the device ---------------------------------------------------------


def check_moe(device: str, seed: int) -> str:
    """ExpertParallelMoE (world size 1, on ``device``) equals DenseMoE on the CPU, float32."""
    from moebalance import Placement
    from moebalance.nn import DenseMoE, ExpertParallelMoE

    torch.backends.cuda.matmul.allow_tf32 = False
    D, F, E, K, T = 64, 48, 8, 2, 333
    dense = DenseMoE(D, F, E, K, seed=seed)
    placement = Placement(np.arange(E)[None], np.ones((1, E)), np.zeros(E, dtype=np.int64), E)
    gen = torch.Generator().manual_seed(seed)
    x_cpu = torch.randn(T, D, generator=gen)
    proj = torch.randn(T, D, generator=gen)
    xd = x_cpu.clone().requires_grad_()
    (dense(xd) * proj).sum().backward()
    out_d = dense(x_cpu).detach()
    done = []
    for resplit in (False, True):
        moe = ExpertParallelMoE.from_dense(dense, placement)
        moe.dispatcher = type(moe.dispatcher)(resplit=resplit)
        moe.to(device)
        x = x_cpu.to(device, copy=True).requires_grad_()
        out = moe(x)
        (out * proj.to(device)).sum().backward()
        tol = dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.detach().cpu(), out_d, **tol)
        torch.testing.assert_close(x.grad.cpu(), xd.grad, **tol)
        torch.testing.assert_close(moe.router.weight.grad.cpu(), dense.router.weight.grad, **tol)
        torch.testing.assert_close(moe.experts.gate_up.grad.cpu(), dense.experts.gate_up.grad,
                                   **tol)
        torch.testing.assert_close(moe.experts.down.grad.cpu(), dense.experts.down.grad, **tol)
        done.append(f"resplit={resplit} ok")
    return "outputs and gradients equal DenseMoE: " + ", ".join(done)


# -- 4. no host syncs ---------------------------------------------------------------------------


def check_no_sync(seed: int) -> str:
    """LoadTracker.record, replica_flows and resplit_shares never sync the host (CUDA)."""
    from moebalance import LoadTracker, Placement
    from moebalance.dispatch.routing import replica_flows, replica_table
    from moebalance.dispatch.shares import resplit_plan, resplit_shares

    L, E, T, K = 4, 64, 8192, 8
    tracker = LoadTracker(L, E)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = [torch.randint(0, E, (T, K), device="cuda", generator=gen) for _ in range(L)]
    tracker.record(0, ids[0])                       # first call allocates the counts
    rng = np.random.default_rng(seed)
    phy2log = np.concatenate([np.arange(E), rng.permutation(E)[:16]])
    device = np.repeat(np.arange(8), 10)
    share = 1.0 / np.bincount(phy2log, minlength=E)[phy2log]
    table = replica_table(Placement(phy2log[None], share[None], device, E), 0, "cuda")
    plan = resplit_plan(table, np.linspace(0.5, 1.5, 8), "cuda")
    counts = torch.randint(0, 500, (8, E), device="cuda", generator=gen)
    masks = torch.tensor([[g < 4 for g in range(8)], [g >= 4 for g in range(8)]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            for layer in range(L):
                tracker.record(layer, ids[layer])
            shares = resplit_shares(counts.sum(0), table.share_EX, plan)
            flow = replica_flows(counts, shares, table.device_EX, masks)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    if not torch.equal(flow.sum(dim=2), counts):
        raise AssertionError("the flows under sync-debug mode do not add up to the counts")
    return "12 record calls, 3 re-splits and flow tables without a host sync"


# -- 4b. the per-step re-split kernel (csrc/resplit.cu) ----------------------------------------


def check_resplit(seed: int) -> str:
    """The CUDA re-split (csrc/resplit.cu through CuPy) against the Numba kernel, on placements
    planned for E = 256 on 64 devices x 8 slots, even and uneven speeds; and its time per layer
    (CUDA events, one launch per layer)."""
    import moebalance as mb
    from moebalance.dispatch.resplit_cuda import resplit_shares_cuda
    from moebalance.dispatch.routing import replica_table
    from moebalance.dispatch.shares import RESPLIT_SWEEPS, resplit_plan
    from moebalance.planner import _jit

    rng = np.random.default_rng(seed)
    kernel = _jit.compiled()
    times = []
    for uneven in (False, True):
        speed = rng.choice([1.0, 0.5], 64) if uneven else np.ones(64)
        topo = mb.Topology.from_arrays(speed=speed, slots=[8] * 64)
        placement = mb.plan(rng.gamma(0.7, 100.0, size=(1, 256)), topo)
        table = replica_table(placement, 0)
        plan_cpu = resplit_plan(table, topo.speed)
        plan_gpu = resplit_plan(table.to("cuda"), topo.speed, device="cuda")
        for _ in range(8):
            w = rng.poisson(rng.gamma(0.7, 300.0, 256)).astype(np.float64)
            w[rng.random(256) < 0.1] = 0.0
            for exact in (False, True):
                want = table.share_EX.numpy().copy()
                load = np.empty(64)
                kernel.resplit_layer(w, plan_cpu.device_EX.numpy(), plan_cpu.speed_G.numpy(),
                                     plan_cpu.order_V.numpy(), want, load, RESPLIT_SWEEPS, exact)
                w_gpu, share_gpu = torch.from_numpy(w).cuda(), table.share_EX.cuda()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                got = resplit_shares_cuda(w_gpu, share_gpu, plan_gpu, sweeps=RESPLIT_SWEEPS,
                                          exact=exact)
                end.record()
                torch.cuda.synchronize()
                if exact:
                    times.append(start.elapsed_time(end) * 1e3)
                if not np.allclose(got.cpu().numpy(), want, rtol=1e-9, atol=1e-12):
                    raise AssertionError(f"CUDA re-split differs from the Numba kernel "
                                         f"(uneven={uneven}, exact={exact})")
    return (f"32 layers equal to the Numba kernel; {np.median(times):.0f} us per layer "
            f"(median, CUDA events, exact)")


# -- 5. bandwidth -------------------------------------------------------------------------------


def measure_bandwidth(results: Results, seed: int) -> str:
    """GB/s of permute (gather_rows) and combine against copy_ of the same bytes, measured by
    the dispatch benchmark's GPU section (``moebalance bench dispatch --sections gpu``)."""
    from moebalance.benchmarks.dispatch import run_gpu

    rows = run_gpu(tokens=16384, hidden=2048, top_k=8, slots=256, repeats=20, seed=seed)
    worst = []
    for row in rows:
        kernel = row.op.split()[0] in ("gather_rows", "combine")
        results.figures.append({"name": f"{row.op} ({row.method})", "gbps": row.gbps,
                                "vs_copy": row.vs_copy, "ms": row.ms,
                                "target": f">= {BANDWIDTH_TARGET:.0%} of copy" if kernel else ""})
        if kernel:
            worst.append(row.vs_copy)
    if min(worst) < BANDWIDTH_TARGET:
        raise AssertionError(f"a kernel reached {min(worst):.0%} of the copy bandwidth, below "
                             f"the {BANDWIDTH_TARGET:.0%} target")
    return f"every kernel >= {min(worst):.0%} of the device copy bandwidth"


# -- main ---------------------------------------------------------------------------------------


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("cupy", "numba"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    info = environment()
    out = Path(args.out)
    if args.device == "cuda" and not torch.cuda.is_available():
        message = ("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                   "nothing was checked. Run it on a machine with an NVIDIA GPU, torch with "
                   "CUDA, CuPy and Numba, or pass --device cpu for the CPU forms of the checks.")
        print(message)
        out.write_text(json.dumps({"status": "no-gpu", "message": message,
                                   "environment": info}, indent=2) + "\n")
        return 0
    from moebalance.backends import has_cupy_gpu

    started = time.perf_counter()
    results = Results()
    shapes = QUICK_KERNEL_SHAPES if args.quick else KERNEL_SHAPES
    if args.device == "cuda" and not has_cupy_gpu():
        results.checks.append({"check": "kernels (csrc through CuPy)", "ok": False,
                               "detail": "CuPy is missing or sees no GPU", "seconds": 0.0})
    else:
        label = "kernels (csrc through CuPy)" if args.device == "cuda" else "kernels (Numba)"
        results.run(label, check_kernels, args.device, shapes, args.seed)
    results.run("experts (grouped GEMM vs slot loop)", check_experts, args.device, args.seed)
    results.run("moe (ExpertParallelMoE vs DenseMoE)", check_moe, args.device, args.seed)
    if args.device == "cuda":
        results.run("no sync (record, flows, re-split)", check_no_sync, args.seed)
        if has_cupy_gpu():
            results.run("re-split (csrc/resplit.cu vs Numba)", check_resplit, args.seed)
        if not args.quick and has_cupy_gpu():
            results.run("bandwidth (permute, combine vs copy)", measure_bandwidth, results,
                        args.seed)
    elapsed = time.perf_counter() - started
    out.write_text(json.dumps({"status": "failed" if results.failed else "passed",
                               "environment": info, "device": args.device,
                               "quick": args.quick, "seed": args.seed,
                               "wall_s": round(elapsed, 1), "checks": results.checks,
                               "figures": results.figures}, indent=2) + "\n")
    print()
    print(f"gpu_check on {info.get('gpu', args.device)}: {len(results.checks) - results.failed}/"
          f"{len(results.checks)} checks passed in {elapsed:.0f} s; wrote {out}")
    print(results.table())
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
