"""GPU check: every CUDA path of moebalance against its CPU reference, in one unattended run.

The one command for a machine with a CUDA GPU, from the repository root:

    python3 scripts/gpu_check.py                  # every check, sized for <= 6 min on one H200
    python3 scripts/gpu_check.py --sanitize       # + compute-sanitizer memcheck, synccheck (5 min)
    python3 scripts/gpu_check.py --only kernels   # one check (repeat --only for more)
    python3 scripts/gpu_check.py --device cpu     # the checks' CPU forms (any machine)

Installing is optional: the script finds the repository from its own path and imports
``moebalance`` from there, the CUDA sources (``moebalance._csrc``) from ``csrc/`` when no install
maps them. To install on a machine without a package index (setuptools and wheel present):

    python3 -m pip install --no-deps --no-build-isolation --no-index -e .

Needs torch with CUDA and CuPy (Numba for the CPU forms); no network. Each check runs in its own
process with its own timeout (a crash or an illegal address loses that check only), and the JSON
(``--out``) is rewritten after every check. The checks, on seeded random inputs:

1. ``kernels``: the ``csrc/`` dispatch kernels through CuPy (route, sort_by_slot, gather_rows
   plain and scaled, combine plain and weighted, combine_weight_grad) against the torch
   reference on the CPU, float32/float64/bfloat16/float16, small and model-sized shapes.
2. ``inputs``: the kernels on edge inputs: ``out=`` and sources at misaligned addresses (slices of
   a larger buffer), expert ids -1 (dropped pairs: slot -1, no position), empty inputs.
3. ``experts``: the local slots' SwiGLU through ``torch._grouped_mm`` against the slot loop,
   forward and backward, including bfloat16 groups whose row counts are not multiples of 8.
4. ``moe``: ``ExpertParallelMoE`` at world size 1 on the GPU (with and without the per-step
   re-split) against ``DenseMoE`` on the CPU, outputs and every gradient, float32.
5. ``no-sync``: ``LoadTracker.record``, the routing flows and the re-split under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises.
   ``resplit``: ``csrc/resplit.cu`` through CuPy against the Numba re-split kernel, on
   placements for 256 experts on 64 devices x 8 slots (even and uneven speeds), 300 x 2 (more
   devices than a block's threads) and 64 x 4 (no replicated expert), and its time per layer on
   64 x 8 (CUDA events).
6. ``syncs``: one ``ExpertParallelMoE`` step (forward, backward, ``clip_grad_norm_``) and a live
   migration (``apply_placement(blocking=False)``, then the step that commits it) under
   ``set_sync_debug_mode("warn")``; every sync is counted with its source line and compared
   with the documented ones: one per dispatch (the split sizes, ``dispatch/dispatcher.py``),
   none in the migration's staging and commit at world size 1 (with NCCL each committed layer's
   agreement among the ranks adds one). The migration must keep the layer's function
   and move the optimizer state with the rows (also checked on the CPU).
7. ``bandwidth``: GB/s of the CUDA gather_rows (permute) and combine kernels against the device's
   copy bandwidth (``copy_`` of the same bytes), float32 and bfloat16, timed with CUDA events
   over repeated launches by the dispatch benchmark's GPU section; target >= 80%.
8. ``sanitize-memcheck``, ``sanitize-synccheck`` (``--sanitize``): checks 1 and 2 on small shapes
   and the re-split on 300 x 2 and 64 x 4 under ``compute-sanitizer`` (the caching allocator
   off, so out-of-bounds accesses show). synccheck, not racecheck: the kernels use no shared
   memory, and the warp intrinsics (``__match_any_sync``, ``__syncwarp``, shuffles) are what
   synccheck checks.

Without a CUDA GPU (and ``--device cuda``) it says so and exits 0 having checked nothing. It
prints a table last. Exit status 1 when any check fails.

Legend: T tokens, K top-k, E experts, S slots, D hidden size, F expert hidden size, N = T*K.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
INSTALL_LINE = "python3 -m pip install --no-deps --no-build-isolation --no-index -e ."
CSRC_PACKAGE = "moebalance._csrc"


def use_repository(root: Path = ROOT, csrc_package: str = CSRC_PACKAGE) -> None:
    """Import ``moebalance`` from ``root`` and its CUDA sources from ``root/csrc`` as
    ``csrc_package`` (what ``[tool.setuptools.package-dir]`` maps on install): the checks test
    this checkout, whether or not it (or another one) is installed."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    init = root / "csrc" / "__init__.py"
    if not init.exists():
        return            # not run from a checkout: the installed package brings its sources
    spec = importlib.util.spec_from_file_location(
        csrc_package, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[csrc_package] = module
    spec.loader.exec_module(module)
    parent, _, child = csrc_package.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


use_repository()

# (T, K, E, S, D): small odd shapes, then model-sized ones.
KERNEL_SHAPES = [(1, 1, 3, 3, 5), (37, 8, 16, 24, 33), (513, 6, 32, 40, 7),
                 (4096, 8, 64, 96, 1024), (300, 2, 4, 4, 7168)]
QUICK_KERNEL_SHAPES = KERNEL_SHAPES[:3]
SANITIZE_KERNEL_SHAPES = KERNEL_SHAPES[:2]
BANDWIDTH_TARGET = 0.8
# The host syncs documented on the per-step path: one per dispatch (dispatch/dispatcher.py).
DOCUMENTED_SYNCS_PER_DISPATCH = 1
# Wall-clock budget of a whole run (every check's timeout is cut to what is left of it), and
# what --sanitize adds to it.
BUDGET_S = 360.0
SANITIZE_BUDGET_S = 300.0


# -- running each check in its own process ----------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: ``run(args)`` returns a detail line (and may add figures) or raises."""

    name: str
    title: str
    devices: tuple[str, ...]      # where it runs: "cuda", "cpu"
    timeout_s: float
    run: Callable
    full_only: bool = False       # skipped by --quick
    sanitizer: str | None = None  # run under compute-sanitizer with this tool


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=(
        "Check every CUDA path of moebalance against its CPU reference, count the host syncs "
        "of a training step and a live migration, and measure the dispatch kernels' bandwidth "
        f"against the device's copy bandwidth. Offline install (optional): {INSTALL_LINE}"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): the full check; cpu: the checks that have a CPU "
                             "form (Numba kernels, edge inputs, grouped GEMM, ExpertParallelMoE, "
                             "live migration)")
    parser.add_argument("--quick", action="store_true", help="small shapes only, no bandwidth")
    parser.add_argument("--sanitize", action="store_true",
                        help="also run the kernel checks under compute-sanitizer (memcheck, "
                             "synccheck) on small shapes")
    parser.add_argument("--only", action="append", choices=[c.name for c in CHECKS],
                        metavar="NAME", help="run only this check (repeatable): "
                        + ", ".join(c.name for c in CHECKS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"wall-clock budget of the run in seconds (default {BUDGET_S:.0f}, "
                             f"{SANITIZE_BUDGET_S:.0f} more with --sanitize)")
    parser.add_argument("--out", default="gpu_check.json", metavar="FILE",
                        help="where to write the JSON results (default gpu_check.json)")
    # Internal: run one check in this process and write its result to --result.
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_isolated(command: list[str], timeout_s: float, result_file: Path,
                 env: dict | None = None) -> dict:
    """Run ``command`` (one check) in its own process group with a timeout.

    Returns the result it wrote to ``result_file`` ({"ok", "detail", "figures"}), or a failure
    saying how the process ended: killed by a signal (a segfault), an exit status without a
    result, or the timeout (its whole process group is killed).
    """
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=max(timeout_s, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - start
    tail = "\n".join((output or "").strip().splitlines()[-15:])
    result = None
    if result_file.exists():
        try:
            result = json.loads(result_file.read_text())
        except json.JSONDecodeError:
            result = None
    if timed_out:
        result = {"ok": False, "detail": f"timed out after {timeout_s:.0f} s (process killed)"}
    elif result is None:
        code = proc.returncode
        how = (f"killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        result = {"ok": False, "detail": f"the check's process {how} before reporting"}
    elif proc.returncode not in (0, None) and result.get("ok"):
        # compute-sanitizer reports its findings through the exit status (--error-exitcode).
        result = {**result, "ok": False,
                  "detail": f"exit status {proc.returncode}: {result['detail']}"}
    result.setdefault("figures", [])
    result["seconds"] = round(seconds, 2)
    result["output_tail"] = tail if not result["ok"] else ""
    return result


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and Path(home, "bin", "compute-sanitizer").exists():
            return str(Path(home, "bin", "compute-sanitizer"))
    return None


def _command(check: Check, args: argparse.Namespace, result_file: Path) -> list[str] | str:
    """The command line of one check's process (or the reason it cannot run)."""
    command = [sys.executable, str(SCRIPT), "--run-one", check.name, "--device", args.device,
               "--seed", str(args.seed), "--result", str(result_file)]
    if args.quick:
        command.append("--quick")
    if check.sanitizer is None:
        return command
    tool = _sanitizer()
    if tool is None:
        return "compute-sanitizer is not on PATH nor under CUDA_HOME/bin or /usr/local/cuda/bin"
    return [tool, "--tool", check.sanitizer, "--error-exitcode", "86", "--print-limit", "20",
            *command]


def run_one(args: argparse.Namespace) -> int:
    """Inside a check's process: run it and write {"ok", "detail", "figures"} to --result."""
    check = next(c for c in CHECKS if c.name == args.run_one)
    figures: list[dict] = []
    try:
        detail, ok = check.run(args, figures), True
    except Exception as exc:  # reported to the parent, which goes on with the next check
        traceback.print_exc()
        detail, ok = f"{type(exc).__name__}: {exc}", False
    Path(args.result).write_text(json.dumps({"ok": ok, "detail": str(detail),
                                             "figures": figures}))
    return 0


class Results:
    """Checks (name, status, detail, seconds) and measured figures, printed as one table."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.figures: list[dict] = []

    def add(self, name: str, status: str, detail: str, seconds: float = 0.0,
            output_tail: str = "") -> None:
        self.checks.append({"check": name, "status": status, "ok": status != "FAIL",
                            "detail": detail, "seconds": round(seconds, 2),
                            "output_tail": output_tail})
        print(f"[{status}] {name} ({seconds:.1f} s): {detail}", flush=True)
        if output_tail:
            print("    " + output_tail.replace("\n", "\n    "), flush=True)

    def run(self, name: str, fn, *args) -> None:
        """Run ``fn(*args)`` in this process; it returns a detail string or raises (a failure)."""
        start = time.perf_counter()
        try:
            detail, status = str(fn(*args)), "PASS"
        except Exception as exc:  # every failure is recorded and the run goes on
            detail, status = f"{type(exc).__name__}: {exc}", "FAIL"
            traceback.print_exc()
        self.add(name, status, detail, time.perf_counter() - start)

    @property
    def failed(self) -> int:
        return sum(c["status"] == "FAIL" for c in self.checks)

    def table(self) -> str:
        lines = [f"{'check':<44} {'result':<6} {'s':>6}  detail"]
        lines += [f"{c['check']:<44} {c['status']:<6} {c['seconds']:>6.1f}  "
                  f"{c['detail'][:90]}" for c in self.checks]
        if self.figures:
            lines += ["", f"{'figure':<44} {'value':>10}  {'vs copy':>8}  target"]
            lines += [f"{f['name']:<44} {f['gbps']:>8.1f} GB/s {f['vs_copy']:>7.2f}x  "
                      f"{f['target']}" for f in self.figures]
        return "\n".join(lines)


# -- dispatch kernels ----------------------------------------------------------------------------


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


def _kernels(device: str):
    if device == "cuda":
        from moebalance.dispatch import cuda as kernels
    else:
        from moebalance.dispatch import numba_kernels as kernels
    return kernels


def check_kernels(args, figures, shapes=None) -> str:
    """The device's dispatch kernels equal the torch reference (run on the CPU)."""
    from moebalance.dispatch import reference

    device, seed = args.device, args.seed
    shapes = shapes or (QUICK_KERNEL_SHAPES if args.quick else KERNEL_SHAPES)
    kernels = _kernels(device)
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


# -- grouped-GEMM experts -----------------------------------------------------------------------


def check_experts(args, figures) -> str:
    """Grouped-GEMM SwiGLU equals the slot loop, forward and backward; in bfloat16 also for
    groups whose row counts are not multiples of 8 (a known pitfall of grouped GEMM backward)."""
    from moebalance.nn.moe import grouped_mm_runs, grouped_swiglu, looped_swiglu

    device = args.device
    gen = torch.Generator().manual_seed(args.seed)
    ran = []
    dtypes = (torch.bfloat16, torch.float32)
    D, F = 256, 128
    for dtype in dtypes:
        cases = []
        for slots in (8, 16):
            counts = torch.multinomial(torch.ones(slots), 2048, replacement=True,
                                       generator=gen).bincount(minlength=slots)
            counts[1] = 0
            cases.append((f"{slots} slots", counts.tolist()))
        cases.append(("rows 1,3,0,5,7,9,2,13", [1, 3, 0, 5, 7, 9, 2, 13]))
        for label, counts in cases:
            slots, rows = len(counts), sum(counts)
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
            what = f"{label} {str(dtype).replace('torch.', '')}"
            if "grouped" not in results:
                ran.append(f"{what}: grouped_mm does not run here (loop)")
                continue
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            for got, want, part in zip(results["grouped"], results["loop"],
                                       ("y", "x.grad", "gate_up.grad", "down.grad")):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                           msg=lambda m, w=what, p=part: f"{w} {p}: {m}")
            ran.append(f"{what} ok")
    return "; ".join(ran)


# -- ExpertParallelMoE on the device ------------------------------------------------------------


def check_moe(args, figures) -> str:
    """ExpertParallelMoE (world size 1, on ``device``) equals DenseMoE on the CPU, float32."""
    from moebalance import Placement
    from moebalance.nn.moe import DenseMoE, ExpertParallelMoE

    device, seed = args.device, args.seed
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


# -- no host syncs ------------------------------------------------------------------------------


def check_no_sync(args, figures) -> str:
    """LoadTracker.record, replica_flows and resplit_shares never sync the host (CUDA)."""
    seed = args.seed
    from moebalance import LoadTracker, Placement
    from moebalance.dispatch.routing import replica_flows, replica_table
    from moebalance.dispatch.shares import resplit_plan, resplit_shares

    L, E, T, K = 4, 64, 8192, 8
    tracker = LoadTracker(L, E)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = [torch.randint(0, E, (T, K), device="cuda", generator=gen) for _ in range(L)]
    tracker.record(0, ids[0])                       # first call allocates the counts
    rng = np.random.default_rng(seed)
    # 80 slots on 8 devices: each expert once in slots 0-63, then 16 second replicas in slots
    # 64-79 (devices 6 and 7) of experts from devices 0-5, so no device holds an expert twice
    phy2log = np.concatenate([np.arange(E), rng.permutation(60)[:16]])
    device = np.repeat(np.arange(8), 10)
    share = 1.0 / np.bincount(phy2log, minlength=E)[phy2log]
    placement = Placement(phy2log[None], share[None], device, E)
    placement.validate()
    table = replica_table(placement, 0, "cuda")
    plan = resplit_plan(table, np.linspace(0.5, 1.5, 8), "cuda")
    counts = torch.randint(0, 500, (8, E), device="cuda", generator=gen)
    masks = torch.tensor([[g < 4 for g in range(8)], [g >= 4 for g in range(8)]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
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



# -- edge inputs --------------------------------------------------------------------------------


def _misaligned(t: torch.Tensor, device: str) -> torch.Tensor:
    """A contiguous copy of ``t`` on ``device`` one element past an aligned address (a slice of a
    larger buffer, as ``out=`` views often are)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def check_inputs(args, figures) -> str:
    """The kernels on misaligned sources and ``out=`` slices, expert ids -1 and empty inputs."""
    from moebalance.dispatch import reference

    device = args.device
    kernels = _kernels(device)
    gen = torch.Generator().manual_seed(args.seed)
    cases = 0
    # Misaligned pointers: every dtype, a row length with no vector path and one with.
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for D in (13, 64):
            M, T, K = 50, 40, 3
            x = torch.randn(M, D, generator=gen).to(dtype)
            index = torch.randint(0, M, (T * K,), generator=gen)
            scale = torch.rand(T * K, generator=gen).to(dtype)
            what = f"{dtype} D={D}"
            out = _misaligned(torch.zeros(T * K, D, dtype=dtype), device)
            got = kernels.gather_rows(_misaligned(x, device), index.to(device), out=out)
            assert got.data_ptr() == out.data_ptr(), "gather_rows did not fill out="
            _expect_equal(out, reference.gather_rows(x, index), f"gather_rows misaligned {what}",
                          (M, D))
            kernels.gather_rows(_misaligned(x, device), index.to(device),
                                _misaligned(scale, device), out=out)
            _expect_equal(out, reference.gather_rows(x, index, scale),
                          f"gather_rows scaled misaligned {what}", (M, D))
            _, pos, _ = reference.sort_by_slot(torch.randint(0, 5, (T, K), generator=gen), 5)
            y = torch.randn(T * K, D, generator=gen).to(dtype)
            w = torch.rand(T, K, generator=gen).to(dtype)
            out = _misaligned(torch.zeros(T, D, dtype=dtype), device)
            kernels.combine(_misaligned(y, device), pos.to(device), _misaligned(w, device), out=out)
            _expect_equal(out, reference.combine(y, pos, w), f"combine misaligned {what}", (T, D))
            tol = {torch.float64: 1e-12}.get(dtype, 1e-4)
            grad = torch.randn(T, D, generator=gen).to(dtype)
            torch.testing.assert_close(
                kernels.combine_weight_grad(_misaligned(grad, device), _misaligned(y, device),
                                            pos.to(device)).cpu(),
                reference.combine_weight_grad(grad, y, pos), rtol=tol, atol=tol * D)
            cases += 4
    # Expert id -1 (a dropped pair): slot -1, and the sort gives it position -1 (no row, a zero
    # gradient for its weight). The CPU
    # kernels check ids on the host instead, so there it must be a clear ValueError.
    shape = KERNEL_SHAPES[1]
    T, K, E, S, D = shape
    ids, route_args, _, _ = kernel_inputs(shape, args.seed, torch.float32)
    dropped = torch.rand(T, K, generator=gen) < 0.3
    ids = ids.masked_fill(dropped, -1)
    on = lambda t: t.to(device)  # noqa: E731
    if device == "cpu":
        try:
            kernels.route(ids, *route_args)
        except ValueError as exc:
            assert "topk_ids_TK" in str(exc), exc
        else:
            raise AssertionError("the CPU route accepted expert id -1 without an error")
    else:
        slot = kernels.route(on(ids), *map(on, route_args))
        want = reference.route(ids.clamp(min=0), *route_args).masked_fill(dropped, -1)
        _expect_equal(slot, want, "route with ids -1", shape)
        order, pos, counts = kernels.sort_by_slot(slot, S)
        flat, keep = want.reshape(-1), ~dropped.reshape(-1)
        valid = int(keep.sum())
        ref_order = torch.argsort(flat.masked_fill(~keep, S), stable=True)[:valid]
        _expect_equal(order[:valid], ref_order, "sort_by_slot order with slot -1", shape)
        _expect_equal(counts, torch.bincount(flat[keep], minlength=S), "counts with slot -1",
                      shape)
        # the kept pairs, in flat order, sit where ref_order lists them
        place = torch.argsort(ref_order)
        _expect_equal(pos.reshape(-1)[keep.to(device)], place,
                      "sort_by_slot positions with slot -1", shape)
        _expect_equal(pos.reshape(-1)[~keep.to(device)], torch.full((T * K - valid,), -1),
                      "sort_by_slot: a dropped pair's position is -1", shape)
        y = torch.randn(valid, D)
        grad = torch.randn(T, D)
        got = kernels.combine_weight_grad(on(grad), on(y), pos)
        want = torch.zeros(T * K, dtype=torch.float32)
        want[keep.reshape(-1)] = (grad.repeat_interleave(K, 0)[keep.reshape(-1)]
                                  * y[place]).sum(1)
        torch.testing.assert_close(got.reshape(-1).cpu(), want, rtol=1e-4, atol=1e-4 * D,
                                   msg=lambda m: f"combine_weight_grad with dropped pairs: {m}")
    cases += 1
    # Empty inputs: no pairs, no rows, no columns.
    empty = torch.empty(0, 2, dtype=torch.int64)
    slots_EX, bounds_EX = torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64)
    assert kernels.route(on(empty), on(empty), on(slots_EX), on(bounds_EX)).shape == (0, 2)
    order, pos, counts = kernels.sort_by_slot(on(empty), 4)
    assert order.shape == (0,) and pos.shape == (0, 2) and counts.tolist() == [0] * 4
    x = torch.randn(5, 8)
    assert kernels.gather_rows(on(x), on(torch.empty(0, dtype=torch.int64))).shape == (0, 8)
    assert kernels.combine(on(torch.empty(0, 8)), on(empty)).shape == (0, 8)
    pos = torch.tensor([[0, 1], [2, 3]])
    assert kernels.combine(on(torch.empty(4, 0)), on(pos)).shape == (2, 0)
    assert kernels.combine_weight_grad(on(torch.empty(0, 8)), on(torch.empty(0, 8)),
                                       on(empty)).shape == (0, 2)
    got = kernels.combine_weight_grad(on(torch.empty(2, 0)), on(torch.empty(4, 0)), on(pos))
    _expect_equal(got, torch.zeros(2, 2), "combine_weight_grad with D=0", (2, 0))
    cases += 7
    return (f"{cases} edge cases: misaligned sources and out= slices (4 dtypes, 2 row lengths), "
            f"expert ids -1{' (rejected on the host)' if device == 'cpu' else ''}, empty inputs")


# -- host syncs of a step and a live migration --------------------------------------------------


class _SyncCounter:
    """Host syncs inside a ``with`` block (CUDA: torch's sync debug mode, warn level), each with
    the source line that caused it. On the CPU it counts nothing."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.sites: list[str] = []

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.device != "cuda":
            return
        torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(*exc)
        for w in self._records:
            if "synchroniz" in str(w.message):
                path = Path(w.filename)
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                self.sites.append(f"{where}:{w.lineno}")
        torch.cuda.synchronize()

    def count(self) -> int:
        return len(self.sites)

    def describe(self) -> str:
        return f"{self.count()} ({', '.join(sorted(set(self.sites))) or 'none'})"


def start_local_migration(layer, target, optimizer):
    """A live migration of ``layer`` (world size 1) to ``target``: every row copy stays on this
    rank, wired to the layer as ``apply_placement(blocking=False)`` wires it (the layer commits
    right before its next forward).

    ``apply_placement`` moves no row at world size 1: a device holds each expert once, so a new
    placement there is a relabelling of slots that ``align_slots`` undoes. The copies inside a
    rank are what this exercises: staged on the side stream, committed on the compute stream.
    """
    from moebalance.migrate import MigrationPlan, Migrator

    old = layer.placement
    moved = np.flatnonzero(target.phy2log[0] != old.phy2log[0])
    src = np.argsort(old.phy2log[0])[target.phy2log[0][moved]]      # old slot of each expert
    zeros = np.zeros(moved.size, dtype=np.int64)
    plan = MigrationPlan(old, target, zeros, target.phy2log[0][moved], zeros, moved, zeros, src,
                         expert_bytes=1, sent_G=np.zeros(1, dtype=np.int64),
                         received_G=np.zeros(1, dtype=np.int64), changed_layers=(0,))
    migration = Migrator(None).start(plan, {0: layer.slot_parameters()}, optimizer)
    layer._pending = migration
    migration.on_commit(0, lambda index: layer._set_placement(target, index))
    return migration, moved, src


def check_syncs(args, figures) -> str:
    """A training step and a live migration of one ExpertParallelMoE: host syncs (CUDA) equal the
    documented ones, and the migration keeps the layer's function and moves optimizer state."""
    from moebalance import Placement, clip_grad_norm_
    from moebalance.nn.moe import DenseMoE, ExpertParallelMoE

    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    D, F, E, K, T = 64, 48, 8, 2, 256
    dense = DenseMoE(D, F, E, K, seed=args.seed)
    one_device = np.zeros(E, dtype=np.int64)
    old = Placement(np.arange(E)[None], np.ones((1, E)), one_device, E)
    perm = np.random.default_rng(args.seed).permutation(E)
    target = Placement(perm[None], np.ones((1, E)), one_device, E)
    moe = ExpertParallelMoE.from_dense(dense, old).to(device)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0, momentum=0.9)   # weights stay put
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(args.seed)).to(device)

    def finish(out):
        out.square().mean().backward()
        clip_grad_norm_(moe, 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def step():
        out = moe(x)
        finish(out)
        return out.detach()

    step(), step()     # warm-up: compilation, first-use index copies, optimizer state
    with _SyncCounter(device) as steady:
        before = step()
    gate_up = moe.experts.gate_up
    weights = gate_up.detach().clone()
    momentum = optimizer.state[gate_up]["momentum_buffer"].clone()
    with _SyncCounter(device) as staging:
        migration, moved, _ = start_local_migration(moe, target, optimizer)
    with _SyncCounter(device) as commit:
        after = moe(x)          # the layer commits its staged rows right before this forward
        moved_w = gate_up.detach().clone()
        moved_m = optimizer.state[gate_up]["momentum_buffer"].clone()
        finish(after)
    with _SyncCounter(device) as later:
        step()
    if migration.committed != [0] or moe.placement.phy2log[0].tolist() != perm.tolist():
        raise AssertionError(f"the layer did not commit the migration: {migration.report()}")
    index = torch.from_numpy(perm).to(device)
    if not torch.equal(moved_w, weights.index_select(0, index)):
        raise AssertionError("after the migration a slot does not hold its new expert's weights")
    if not torch.equal(moved_m, momentum.index_select(0, index)):
        raise AssertionError("the momentum buffers did not move with their rows")
    torch.testing.assert_close(after.detach().cpu(), before.cpu(), rtol=1e-5, atol=1e-6)
    summary = (f"migration of {moved.size} rows inside the device kept the outputs and moved "
               f"weights and momentum with their experts")
    if device != "cuda":
        return summary + " (syncs are counted on CUDA only)"
    problems = []
    for label, counter in (("steady step", steady), ("step after the migration", later)):
        if counter.count() != DOCUMENTED_SYNCS_PER_DISPATCH:
            problems.append(f"{label}: {counter.describe()}, documented "
                            f"{DOCUMENTED_SYNCS_PER_DISPATCH} (the dispatch's split sizes)")
    if staging.count():
        problems.append(f"migration staging: {staging.describe()}, documented 0")
    in_migration = [s for s in commit.sites if "migrate.py" in s or "device_index.py" in s]
    if in_migration:
        problems.append(f"commit: syncs in the migration itself at {sorted(set(in_migration))}")
    detail = (f"syncs: steady step {steady.describe()}; staging {staging.describe()}; "
              f"committing step {commit.describe()}; next step {later.describe()}; "
              f"documented {DOCUMENTED_SYNCS_PER_DISPATCH} per dispatch, none in the migration "
              f"(a new placement's routing tables are built once, at its first dispatch)")
    if problems:
        raise AssertionError("; ".join(problems) + " | " + detail)
    return summary + "; " + detail


# -- the per-step re-split kernel (csrc/resplit.cu) ------------------------------------------


# (devices, slots per device, uneven speeds, layers): 64 x 8 is the timed shape; 300 devices
# take the kernel's thread-strided loops (256 threads) past one pass; 64 x 4 slots hold each of
# the 256 experts once, so no expert is re-split (no colour class).
RESPLIT_CASES = ((64, 8, False, 8), (64, 8, True, 8), (300, 2, True, 2), (64, 4, False, 1))
SANITIZE_RESPLIT_CASES = ((300, 2, True, 1), (64, 4, False, 1))


def check_resplit(args, figures, cases=RESPLIT_CASES, timed: bool = True) -> str:
    """The CUDA re-split (csrc/resplit.cu through CuPy) against the Numba kernel, on placements
    planned for E = 256 on each case's devices (:data:`RESPLIT_CASES`); and the time of a layer
    on 64 devices x 8 slots (CUDA events around the call, one launch per layer, after a first
    call that compiles)."""
    import moebalance as mb
    from moebalance.dispatch.resplit_cuda import resplit_shares_cuda
    from moebalance.dispatch.routing import replica_table
    from moebalance.dispatch.shares import RESPLIT_SWEEPS, resplit_plan
    from moebalance.planner import _jit

    rng = np.random.default_rng(args.seed)
    kernel = _jit.kernels("numba")
    times, checked = [], 0
    for G, slots, uneven, layers in cases:
        speed = rng.choice([1.0, 0.5], G) if uneven else np.ones(G)
        topo = mb.Topology.from_arrays(speed=speed, slots=[slots] * G)
        placement = mb.plan(rng.gamma(0.7, 100.0, size=(1, 256)), topo)
        table = replica_table(placement, 0)
        plan_cpu = resplit_plan(table, topo.speed)
        plan_gpu = resplit_plan(table.to("cuda"), topo.speed, device="cuda")
        for _ in range(layers):
            w = rng.poisson(rng.gamma(0.7, 300.0, 256)).astype(np.float64)
            w[rng.random(256) < 0.1] = 0.0
            for exact in (False, True):
                want = table.share_EX.numpy().copy()
                load = np.empty(G)
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
                if exact and (G, slots) == (64, 8) and checked:
                    times.append(start.elapsed_time(end) * 1e3)
                checked += 1
                if not np.allclose(got.cpu().numpy(), want, rtol=1e-9, atol=1e-12):
                    raise AssertionError(f"CUDA re-split differs from the Numba kernel "
                                         f"({G} devices x {slots} slots, uneven={uneven}, "
                                         f"exact={exact})")
    shapes = ", ".join(f"{G} x {slots}" for G, slots, _, _ in cases)
    detail = f"{checked} re-splits equal to the Numba kernel ({shapes} slots)"
    if not timed or not times:
        return detail
    figures.append({"name": "re-split (CUDA, exact)", "us_per_layer": float(np.median(times))})
    return (f"{detail}; {np.median(times):.0f} us per layer (median, CUDA events around the "
            f"call as the dispatcher makes it: host checks, copies and the launch included)")


# -- bandwidth ----------------------------------------------------------------------------------


def measure_bandwidth(args, figures) -> str:
    """GB/s of permute (gather_rows) and combine against copy_ of the same bytes, measured by
    the dispatch benchmark's GPU section (``moebalance bench dispatch --sections gpu``) with
    CUDA events around repeated launches."""
    from moebalance.lab.bench.dispatch import run_gpu

    rows = run_gpu(tokens=16384, hidden=2048, top_k=8, slots=256, repeats=10, seed=args.seed)
    worst = []
    for row in rows:
        kernel = row.op.split()[0] in ("gather_rows", "combine")
        figures.append({"name": f"{row.op} ({row.method})", "gbps": row.gbps,
                        "vs_copy": row.vs_copy, "ms": row.ms,
                        "target": f">= {BANDWIDTH_TARGET:.0%} of copy" if kernel else ""})
        if kernel:
            worst.append(row.vs_copy)
    if min(worst) < BANDWIDTH_TARGET:
        raise AssertionError(f"a kernel reached {min(worst):.0%} of the copy bandwidth, below "
                             f"the {BANDWIDTH_TARGET:.0%} target")
    return f"every kernel >= {min(worst):.0%} of the device copy bandwidth"


def sanitize_kernels(args, figures) -> str:
    """Checks 1 and 2 on small shapes, and the re-split on two (run under compute-sanitizer by
    the parent)."""
    detail = check_kernels(args, figures, shapes=SANITIZE_KERNEL_SHAPES)
    detail += "; " + check_inputs(args, figures)
    detail += "; " + check_resplit(args, figures, cases=SANITIZE_RESPLIT_CASES, timed=False)
    return detail + " (no sanitizer finding)"


CHECKS = [
    Check("kernels", "kernels (csrc through CuPy; Numba on cpu)", ("cuda", "cpu"), 120,
          check_kernels),
    Check("inputs", "edge inputs (misaligned, -1 ids, empty)", ("cuda", "cpu"), 60, check_inputs),
    Check("experts", "experts (grouped GEMM vs slot loop)", ("cuda", "cpu"), 90, check_experts),
    Check("moe", "moe (ExpertParallelMoE vs DenseMoE)", ("cuda", "cpu"), 90, check_moe),
    Check("no-sync", "no sync (record, flows, re-split)", ("cuda",), 60, check_no_sync),
    Check("resplit", "re-split (csrc/resplit.cu vs Numba)", ("cuda",), 120, check_resplit),
    Check("syncs", "syncs (step + live migration)", ("cuda", "cpu"), 90, check_syncs),
    Check("bandwidth", "bandwidth (permute, combine vs copy)", ("cuda",), 90, measure_bandwidth,
          full_only=True),
    Check("sanitize-memcheck", "compute-sanitizer memcheck (kernels, inputs, re-split)",
          ("cuda",), 150,
          sanitize_kernels, sanitizer="memcheck"),
    Check("sanitize-synccheck", "compute-sanitizer synccheck (kernels, inputs, re-split)",
          ("cuda",), 150,
          sanitize_kernels, sanitizer="synccheck"),
]


# -- main ---------------------------------------------------------------------------------------


def environment() -> dict:
    import moebalance

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(),
            "moebalance": str(Path(moebalance.__file__).parent),
            "csrc": str(importlib.util.find_spec(CSRC_PACKAGE).submodule_search_locations[0])}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("cupy", "numba"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def selected_checks(args: argparse.Namespace) -> list[Check]:
    """The checks this run makes, in order: --only, else every check for the device
    (bandwidth not with --quick, the sanitizer passes only with --sanitize)."""
    if args.only:
        return [c for c in CHECKS if c.name in args.only and args.device in c.devices]
    return [c for c in CHECKS if args.device in c.devices
            and (c.sanitizer is None or args.sanitize) and not (c.full_only and args.quick)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_one:
        return run_one(args)
    info = environment()
    out = Path(args.out)
    print(f"gpu_check: moebalance from {info['moebalance']}, CUDA sources from {info['csrc']}. "
          f"To install it offline (optional), from the repository root: {INSTALL_LINE}",
          flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        message = ("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                   "nothing was checked. Run it on a machine with an NVIDIA GPU, torch with "
                   "CUDA, CuPy and Numba, or pass --device cpu for the CPU forms of the checks.")
        print(message)
        out.write_text(json.dumps({"status": "no-gpu", "message": message,
                                   "environment": info}, indent=2) + "\n")
        return 0
    started = time.perf_counter()
    results = Results()
    checks = selected_checks(args)
    if args.budget_s is None:
        args.budget_s = BUDGET_S + (SANITIZE_BUDGET_S if args.sanitize else 0.0)

    def write(status: str) -> None:
        out.write_text(json.dumps({
            "status": status, "environment": info, "device": args.device, "quick": args.quick,
            "sanitize": args.sanitize, "seed": args.seed, "install": INSTALL_LINE,
            "wall_s": round(time.perf_counter() - started, 1),
            "planned": [c.name for c in checks], "checks": results.checks,
            "figures": results.figures}, indent=2) + "\n")

    write("running")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for check in checks:
            left = started + args.budget_s - time.perf_counter()
            command = _command(check, args, Path(tmp, f"{check.name}.json"))
            if left < 5:
                results.add(check.title, "SKIP", f"the run's budget of {args.budget_s:.0f} s "
                            f"is spent")
            elif isinstance(command, str):
                results.add(check.title, "FAIL", command)
            else:
                env = dict(os.environ)
                if check.sanitizer is not None:
                    # Each tensor its own allocation, so an access past its end is reported.
                    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
                result = run_isolated(command, min(check.timeout_s, left),
                                      Path(tmp, f"{check.name}.json"), env)
                results.figures += result["figures"]
                results.add(check.title, "PASS" if result["ok"] else "FAIL", result["detail"],
                            result["seconds"], result["output_tail"])
            write("running")
    skipped = sum(c["status"] == "SKIP" for c in results.checks)
    status = "failed" if results.failed else "incomplete" if skipped else "passed"
    write(status)
    elapsed = time.perf_counter() - started
    print()
    print(f"gpu_check on {info.get('gpu', args.device)}: "
          f"{sum(c['status'] == 'PASS' for c in results.checks)}/{len(results.checks)} checks "
          f"passed in {elapsed:.0f} s ({status}); wrote {out}")
    print(results.table())
    return 0 if status == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
