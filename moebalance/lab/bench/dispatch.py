"""Dispatch benchmark: the permute / unpermute kernels and the dispatch + combine exchange.

Sections (``--sections``, default all that can run here):

1. ``cpu``: permute (counting sort by slot + row gather) and unpermute (weighted combine) with the
   Numba kernels, against the baseline Megatron-style path (``torch.argsort(stable=True)`` +
   ``index_select`` to permute, ``index_add_`` of weighted rows to unpermute) and against a plain
   copy of the same bytes (``clone`` / ``copy_``). Fresh outputs and reused (``out=``) outputs
   are timed separately: on CPU a fresh large buffer costs a page fault per 4 KiB on first touch.
2. ``dist``: ``Dispatcher.dispatch`` + ``combine`` on gloo ranks (spawned processes on
   127.0.0.1), once with each row exchange (``exchange="p2p"``, the gloo default, and
   ``"all_to_all"``, the NCCL default), against a raw ``all_to_all_single`` pair moving the same
   rows.
   A third Dispatcher re-splits every step (``resplit=True``, the default; the others are
   built with ``resplit=False``), to show what that costs.
3. ``gpu``: only with CuPy and a CUDA GPU: GB/s of the CUDA ``gather_rows`` and ``combine`` kernels
   against torch's device copy bandwidth, timed with CUDA events around 20 back-to-back launches
   (not host timers around one launch, which would add the host's launch cost to each kernel).
4. ``shares``: shares realised on 4 gloo ranks with uneven traffic (tokens per rank
   [12000, 6000, 0, 14000], one expert preference) and with per-rank preferences (equal batches,
   each rank favouring another expert): the largest ``|rows received - share x global pairs|``
   over all replicas, with and without node preference.
5. ``experts``: the local slots' SwiGLU forward + backward through ``torch._grouped_mm`` against
   the slot loop, at 8 and 16 local slots, float32 and bfloat16 (CPU; the GPU too when present).

Timing: every repeat runs each method once, in turn (interleaved), and the median is reported.
GB/s counts the bytes a method must move: permute reads and writes N*D elements, unpermute reads
N*D and writes T*D, a copy reads and writes its bytes.

Legend: T tokens, D hidden size, K top-k, N = T*K routed rows, S slots.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...backends import has_cupy_gpu, has_numba
from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, phase, slowest

DESCRIPTION = ("Benchmark the token dispatch: Numba permute/unpermute kernels vs argsort + "
               "index_select vs a plain copy (CPU), dispatch + combine with each row exchange vs "
               "raw all_to_all_single (gloo ranks), and the CUDA kernels vs device copy bandwidth "
               "(GPU, when present).")
FULL = {"tokens": 16384, "hidden": 1024, "top_k": 8, "slots": 64, "repeats": 7,
        "dist_tokens": 2048, "dist_hidden": 512, "dist_repeats": 10,
        "expert_rows": 8192, "expert_hidden": 512, "expert_ffn": 256}
QUICK = {"tokens": 2048, "hidden": 1024, "top_k": 8, "slots": 64, "repeats": 5,
         "dist_tokens": 256, "dist_hidden": 256, "dist_repeats": 5,
         "expert_rows": 1024, "expert_hidden": 256, "expert_ffn": 128}
SHARE_TRAFFIC = {"uneven batches": (12000, 6000, 0, 14000), "rank preferences": (3000,) * 4}
SHARE_COLUMNS = ["traffic", "nodes", "pairs", "replicas", "max |rows - share x pairs|"]
SECTIONS = ("cpu", "dist", "gpu", "shares", "experts")
DIST_MODES = ("p2p", "all_to_all")   # the Dispatcher's row exchanges, each timed
COLUMNS = ["section", "op", "method", "ms", "GB/s", "GFLOP/s", "vs copy"]


@dataclass
class Row:
    section: str
    op: str
    method: str
    ms: float
    gbps: float | None  # bytes moved per second; None where a rate of work is the measure
    vs_copy: float | None = None
    gflops: float | None = None  # the experts section: arithmetic per second


# -- timing helpers ---------------------------------------------------------------------------


def interleaved(methods: dict[str, Callable[[], object]], repeats: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds of each method over ``repeats`` rounds, one call of each per round."""
    for fn in methods.values():  # warm-up: JIT, allocator, caches
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# -- section 1: CPU kernels -------------------------------------------------------------------


def run_cpu(tokens: int, hidden: int, top_k: int, slots: int, repeats: int, seed: int) -> list[Row]:
    """Numba permute/unpermute vs argsort + index_select / index_add_ vs plain copies (fp32)."""
    import torch

    from ...dispatch import numba_kernels as nk

    gen = torch.Generator().manual_seed(seed)
    T, D, K, S = tokens, hidden, top_k, slots
    N = T * K
    x = torch.randn(T, D, generator=gen)
    slot_TK = torch.randint(0, S, (T, K), generator=gen)
    w_TK = torch.rand(T, K, generator=gen)
    order, pos, _ = nk.sort_by_slot(slot_TK, S)
    y = nk.gather_rows(x, order // K)
    y_out, x_out, y_copy = torch.empty_like(y), torch.empty_like(x), torch.empty_like(y)

    def ours_permute():
        o, p, _ = nk.sort_by_slot(slot_TK, S)
        return nk.gather_rows(x, o // K)

    def ours_permute_out():
        o, p, _ = nk.sort_by_slot(slot_TK, S)
        return nk.gather_rows(x, o // K, out=y_out)

    def base_permute():
        o = torch.argsort(slot_TK.view(-1), stable=True)
        return x.index_select(0, o // K)

    def base_unpermute():
        out = torch.zeros(T, D)
        return out.index_add_(0, order // K, y * w_TK.view(-1)[order].unsqueeze(1))

    timed = interleaved({
        "permute/numba": ours_permute,
        "permute/numba out=": ours_permute_out,
        "permute/argsort+index_select": base_permute,
        "unpermute/numba": lambda: nk.combine(y, pos, w_TK),
        "unpermute/numba out=": lambda: nk.combine(y, pos, w_TK, out=x_out),
        "unpermute/index_add_": base_unpermute,
        "copy/clone": lambda: y.clone(),
        "copy/copy_": lambda: y_copy.copy_(y),
    }, repeats)
    row_bytes = D * 4
    moved = {"permute": 2 * N * row_bytes, "unpermute": (N + T) * row_bytes,
             "copy": 2 * N * row_bytes}
    fresh_copy, reused_copy = (_gbps(moved["copy"], timed["copy/clone"]),
                               _gbps(moved["copy"], timed["copy/copy_"]))
    rows = []
    for key, seconds in timed.items():
        op, method = key.split("/", 1)
        gbps = _gbps(moved[op], seconds)
        reference_copy = reused_copy if method.endswith("out=") or method == "copy_" else fresh_copy
        rows.append(Row("cpu", op, method, seconds * 1e3, gbps, gbps / reference_copy))
    ours = timed["permute/numba"] + timed["unpermute/numba"]
    ours_out = timed["permute/numba out="] + timed["unpermute/numba out="]
    base = timed["permute/argsort+index_select"] + timed["unpermute/index_add_"]
    both = moved["permute"] + moved["unpermute"]
    rows += [Row("cpu", "permute+unpermute", "numba", ours * 1e3, _gbps(both, ours),
                 _gbps(both, ours) / fresh_copy),
             Row("cpu", "permute+unpermute", "numba out=", ours_out * 1e3, _gbps(both, ours_out),
                 _gbps(both, ours_out) / reused_copy),
             Row("cpu", "permute+unpermute", "baseline", base * 1e3, _gbps(both, base),
                 _gbps(both, base) / fresh_copy)]
    return rows


# -- section 2: dispatch + combine on gloo ranks ----------------------------------------------


def bench_placement(num_ranks: int):
    """Three slots per rank: experts 2r, 2r+1 and a replica of expert (2r+2) mod 2G (share 1/2)."""
    from ...placement import Placement

    E = 2 * num_ranks
    phy2log = np.array([[e for r in range(num_ranks) for e in (2 * r, 2 * r + 1, (2 * r + 2) % E)]])
    replicas = np.bincount(phy2log[0], minlength=E)
    share = 1.0 / replicas[phy2log]
    device = np.repeat(np.arange(num_ranks), 3)
    return Placement(phy2log, share, device, E).validate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, world: int, port: int, cfg: dict, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if has_numba():
        import numba

        numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        from ...dispatch import Dispatcher

        T, D, K = cfg["tokens"], cfg["hidden"], cfg["top_k"]
        gen = torch.Generator().manual_seed(cfg["seed"] + rank)
        placement = bench_placement(world)
        x = torch.randn(T, D, generator=gen)
        ids = torch.stack([torch.randperm(placement.num_experts, generator=gen)[:K]
                           for _ in range(T)])
        weights = torch.rand(T, K, generator=gen)
        dispatchers = {mode: Dispatcher(group=None, exchange=mode, resplit=False)
                       for mode in DIST_MODES}
        dispatchers["p2p, resplit"] = Dispatcher(group=None, exchange="p2p", resplit=True)
        send = torch.randn(T * K, D, generator=gen)
        recv = torch.empty_like(send)
        back = torch.empty_like(send)

        def dispatch_combine(d):
            recv_x, handle = d.dispatch(x, ids, weights, placement, 0)
            return d.combine(recv_x, handle)

        def raw_pair():
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(back, recv)

        # The same pair with the dispatch's own split sizes: rows that the routing keeps on
        # their rank (local replicas first) cross no link, so this is the exchange's floor.
        _, handle = dispatchers["p2p"].dispatch(x, ids, weights, placement, 0)
        sent, received = handle.send_splits, handle.recv_splits
        send_routed = torch.randn(sum(sent), D, generator=gen)
        recv_routed = torch.empty(sum(received), D)
        back_routed = torch.empty_like(send_routed)

        def raw_pair_routed():
            dist.all_to_all_single(recv_routed, send_routed, received, sent)
            dist.all_to_all_single(back_routed, recv_routed, sent, received)

        methods = {f"dispatch+combine ({mode})": (lambda d=d: dispatch_combine(d))
                   for mode, d in dispatchers.items()}
        methods.update({"all_to_all_single x2": raw_pair,
                        "all_to_all_single x2, routed splits": raw_pair_routed})
        timed = interleaved(methods, cfg["repeats"], sync=dist.barrier)
        seconds = slowest(list(timed.values()))
        if rank == 0:
            result = dict(zip(timed, seconds))
            Path(result_dir, "dist.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_dist(num_ranks: int, tokens: int, hidden: int, top_k: int, repeats: int,
             seed: int) -> list[Row]:
    """Dispatcher.dispatch + combine (each row exchange) vs two raw all_to_all_single calls of
    T*K rows per rank."""
    import torch.multiprocessing as mp

    if 2 * num_ranks < top_k:
        raise UsageError(f"--top-k {top_k} needs at least {(top_k + 1) // 2} ranks in the "
                         f"distributed section (the bench model has 2 experts per rank)")
    cfg = {"tokens": tokens, "hidden": hidden, "top_k": top_k, "repeats": repeats, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker, args=(num_ranks, _free_port(), cfg, tmp), nprocs=num_ranks,
                 join=True)
        timed = json.loads(Path(tmp, "dist.json").read_text())
    # Rows each rank sends and receives (about T*K each way, both directions, in and out).
    nbytes = 4 * tokens * top_k * hidden * 4
    label = f"{num_ranks} gloo ranks"
    raw = timed["all_to_all_single x2"]
    return [Row("dist", label, method, seconds * 1e3, _gbps(nbytes, seconds), raw / seconds)
            for method, seconds in timed.items()]


# -- section 3: GPU kernels -------------------------------------------------------------------


def cuda_event_times(methods: dict[str, Callable[[], object]], repeats: int,
                     launches: int = 20) -> dict[str, float]:
    """Median seconds per call of each method on the current CUDA stream, from CUDA events.

    Each repeat times ``launches`` back-to-back calls of one method between two events (methods
    interleaved per repeat), so the figure is the device time per launch: the host's launch cost
    (Python, argument packing) overlaps the kernels in flight instead of being added to each one,
    as host timers around one synchronised launch would do.
    """
    import torch

    for fn in methods.values():      # warm-up: compilation, allocator, caches
        fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / launches)
    return {name: statistics.median(times) for name, times in samples.items()}


def run_gpu(tokens: int, hidden: int, top_k: int, slots: int, repeats: int, seed: int) -> list[Row]:
    """CUDA gather_rows / combine GB/s against a device copy of the same bytes (fp32, bf16),
    timed with CUDA events over repeated launches (:func:`cuda_event_times`)."""
    import torch

    from ...dispatch import cuda

    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, D, K, S = tokens, hidden, top_k, slots
    N = T * K
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(T, D, device="cuda", generator=gen).to(dtype)
        slot_TK = torch.randint(0, S, (T, K), device="cuda", generator=gen)
        w = torch.rand(T, K, device="cuda", generator=gen)
        order, pos, _ = cuda.sort_by_slot(slot_TK, S)
        index = order // K
        y = cuda.gather_rows(x, index)
        y_out, x_out = torch.empty_like(y), torch.empty_like(x)
        timed = cuda_event_times({
            "sort_by_slot": lambda: cuda.sort_by_slot(slot_TK, S),
            "gather_rows": lambda: cuda.gather_rows(x, index, out=y_out),
            "combine": lambda: cuda.combine(y, pos, w, out=x_out),
            "copy_": lambda: y_out.copy_(y),
        }, repeats)
        size = x.element_size()
        moved = {"sort_by_slot": 5 * N * 8, "gather_rows": 2 * N * D * size,
                 "combine": (N + T) * D * size, "copy_": 2 * N * D * size}
        copy_gbps = _gbps(moved["copy_"], timed["copy_"])
        for op, seconds in timed.items():
            gbps = _gbps(moved[op], seconds)
            rows.append(Row("gpu", f"{op} {str(dtype).replace('torch.', '')}",
                            "cuda" if op != "copy_" else "torch", seconds * 1e3, gbps,
                            gbps / copy_gbps))
    return rows


# -- section 4: shares realised ------------------------------------------------------------------


def shares_placement():
    """4 ranks: expert 0 on every rank (shares .1/.2/.3/.4), expert 1 on ranks 0, 1, 3
    (.7/.05/.25), expert 2 on ranks 1, 2 (.35/.65), expert 3 alone on rank 2."""
    from ...placement import Placement

    phy2log = np.array([[0, 1, 0, 1, 2, 0, 2, 3, 0, 1]])
    share = np.array([[0.1, 0.7, 0.2, 0.05, 0.35, 0.3, 0.65, 1.0, 0.4, 0.25]])
    return Placement(phy2log, share, np.array([0, 0, 1, 1, 1, 2, 2, 2, 3, 3]), 4).validate()


def _shares_worker(rank: int, world: int, seed: int, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from ...dispatch import Dispatcher

    placement = shares_placement()
    E = placement.num_experts
    gen = torch.Generator().manual_seed(seed + rank)
    results = []
    for traffic, sizes in SHARE_TRAFFIC.items():
        if traffic == "uneven batches":
            pref = torch.tensor([0.4, 0.3, 0.2, 0.1])
        else:
            pref = torch.full((E,), 0.1)
            pref[rank % E] = 0.7
        T = sizes[rank]
        ids = torch.multinomial(pref.expand(max(T, 1), E), 2, generator=gen)[:T]
        pairs_E = torch.bincount(ids.reshape(-1), minlength=E)
        dist.all_reduce(pairs_E)
        for nodes in (None, (0, 0, 1, 1)):
            _, handle = Dispatcher(nodes=nodes).dispatch(torch.zeros(T, 1), ids,
                                                         torch.ones(T, 2), placement, 0)
            received = [None] * world
            dist.all_gather_object(received, handle.tokens_per_local_slot)
            per_slot = np.concatenate(received)
            expected = placement.share[0] * pairs_E.numpy()[placement.phy2log[0]]
            results.append({"traffic": traffic, "nodes": "none" if nodes is None else "2 nodes",
                            "pairs": int(pairs_E.sum()), "replicas": int(per_slot.size),
                            "max_deviation": float(np.abs(per_slot - expected).max())})
    if rank == 0:
        Path(result_dir, "shares.json").write_text(json.dumps(results))


def run_shares(seed: int) -> list[dict]:
    """Largest deviation of any replica's rows from its share of the global pairs (4 ranks)."""
    from ...launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        launch(_shares_worker, 4, args=(seed, tmp))
        return json.loads(Path(tmp, "shares.json").read_text())


# -- section 5: grouped-GEMM experts -------------------------------------------------------------


def run_experts(rows: int, hidden: int, ffn: int, repeats: int, seed: int,
                devices: Sequence[str]) -> list[Row]:
    """SwiGLU forward + backward of Ls local slots: torch._grouped_mm vs the slot loop."""
    import torch

    from ...nn.moe import grouped_mm_runs, grouped_swiglu, looped_swiglu

    out = []
    gen = torch.Generator().manual_seed(seed)
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        dtypes = (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.bfloat16)
        for slots in (8, 16):
            for dtype in dtypes:
                counts = torch.multinomial(torch.ones(slots), rows, replacement=True,
                                           generator=gen).bincount(minlength=slots).tolist()
                x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_()
                gate_up = (torch.randn(slots, 2 * ffn, hidden, generator=gen) * hidden ** -0.5
                           ).to(device, dtype).requires_grad_()
                down = (torch.randn(slots, hidden, ffn, generator=gen) * ffn ** -0.5
                        ).to(device, dtype).requires_grad_()
                grad = torch.randn(rows, hidden, generator=gen).to(device, dtype)
                if not grouped_mm_runs(x, ffn):
                    continue

                def step(fn):
                    y = fn(x, gate_up, down, counts)
                    y.backward(grad)
                    x.grad = gate_up.grad = down.grad = None

                timed = interleaved({"slot loop": lambda: step(looped_swiglu),
                                     "grouped_mm": lambda: step(grouped_swiglu)}, repeats, sync)
                loop = timed["slot loop"]
                # fwd: 3 GEMMs of 2*M*D*F flops each; bwd twice that
                flops = 3 * 3 * 2 * rows * hidden * ffn
                label = f"{slots} slots {str(dtype).replace('torch.', '')} {device} fwd+bwd"
                for method, seconds in timed.items():
                    out.append(Row("experts", label, method, seconds * 1e3, None,
                                   loop / seconds, gflops=flops / seconds / 1e9))
    return out


# -- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes: T={QUICK['tokens']} (CPU/GPU), {QUICK['dist_tokens']} "
                             f"tokens per rank (dist), {QUICK['repeats']} repeats")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of cpu,dist,gpu,shares,experts (default: "
                             "all; gpu runs only with CuPy and a CUDA GPU)")
    parser.add_argument("--tokens", type=positive_int_arg, default=None,
                        help=f"T of the kernel sections (default {FULL['tokens']})")
    parser.add_argument("--hidden", type=positive_int_arg, default=None,
                        help=f"D of the kernel sections (default {FULL['hidden']})")
    parser.add_argument("--top-k", type=positive_int_arg, default=None,
                        help=f"K, routed experts per token (default {FULL['top_k']})")
    parser.add_argument("--slots", type=positive_int_arg, default=None,
                        help=f"S, slots the kernel sections sort into (default {FULL['slots']})")
    parser.add_argument("--repeats", type=positive_int_arg, default=None,
                        help=f"timed rounds, median reported (default {FULL['repeats']})")
    parser.add_argument("--ranks", type=positive_int_arg, default=4,
                        help="gloo ranks of the distributed section (default 4)")
    parser.add_argument("--dist-tokens", type=positive_int_arg, default=None,
                        help=f"tokens per rank in the distributed section "
                             f"(default {FULL['dist_tokens']})")
    parser.add_argument("--dist-hidden", type=positive_int_arg, default=None,
                        help=f"D in the distributed section (default {FULL['dist_hidden']})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--out", default=os.path.join("bench-out", "dispatch"), metavar="DIR",
                        help="folder for results.json and summary.md "
                             "(default ./bench-out/dispatch)")


def _cells(rows: Sequence[Row]) -> list[list[str]]:
    return [[r.section, r.op, r.method, f"{r.ms:.2f}",
             "" if r.gbps is None else f"{r.gbps:.2f}",
             "" if r.gflops is None else f"{r.gflops:.1f}",
             "" if r.vs_copy is None else f"{r.vs_copy:.2f}x"] for r in rows]


def _share_cells(share_rows: Sequence[dict]) -> list[list[str]]:
    return [[r["traffic"], r["nodes"], str(r["pairs"]), str(r["replicas"]),
             f"{r['max_deviation']:.3f}"] for r in share_rows]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    preset = QUICK if args.quick else FULL
    for key in ("tokens", "hidden", "top_k", "slots", "repeats", "dist_tokens", "dist_hidden"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise UsageError(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    import torch

    notes: list[str] = []
    rows: list[Row] = []
    threads = torch.get_num_threads()
    if has_numba():
        import numba

        threads = f"torch {threads}, numba {numba.get_num_threads()}"
    print(f"moebalance dispatch benchmark: T={args.tokens} D={args.hidden} K={args.top_k} "
          f"S={args.slots}, {args.repeats} interleaved repeats (median); threads: {threads}",
          flush=True)
    started = time.perf_counter()
    t0, prog = time.time(), "moebalance bench dispatch"
    if "cpu" in sections:
        phase(prog, "cpu: permute and unpermute kernels against their baselines", t0)
        if has_numba():
            rows += run_cpu(args.tokens, args.hidden, args.top_k, args.slots, args.repeats,
                            args.seed)
        else:
            notes.append("cpu section skipped: Numba is not installed")
    if "dist" in sections:
        phase(prog, f"dist: dispatch and combine on {args.ranks} spawned gloo ranks (the longest "
                    f"section)", t0)
        rows += run_dist(args.ranks, args.dist_tokens, args.dist_hidden, args.top_k,
                         preset["dist_repeats"] if args.quick else max(args.repeats, 5), args.seed)
        notes.append(f"dist: {args.ranks} gloo ranks on 127.0.0.1, one thread each, "
                     f"{args.dist_tokens} tokens x top-{args.top_k} per rank, "
                     f"D={args.dist_hidden}; time of the slowest rank; 'vs copy' is the raw "
                     "exchange's time (even splits) over each method's; dispatch+combine includes "
                     "routing, sorting, the counts exchange and its host sync, the row exchange "
                     "both ways (p2p: point-to-point messages, own rows never sent; all_to_all: "
                     "the collective plus the slot-major reorder and its inverse) and the "
                     "weighted combine; 'routed splits' sends each rank the rows the dispatch "
                     "sends it, with own rows through the collective as all_to_all does; raw "
                     f"pairs do no permute, reorder or combine")
    if "gpu" in sections:
        if has_cupy_gpu():
            phase(prog, "gpu: CUDA gather_rows and combine", t0)
            rows += run_gpu(args.tokens, args.hidden, args.top_k, args.slots, args.repeats,
                            args.seed)
        else:
            notes.append("gpu section skipped: needs CuPy and a CUDA GPU")
    share_rows: list[dict] = []
    if "shares" in sections:
        phase(prog, "shares: rows each replica receives against its share", t0)
        share_rows = run_shares(args.seed)
    if "experts" in sections:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        phase(prog, f"experts: slot loop against grouped_mm on {', '.join(devices)}", t0)
        rows += run_experts(preset["expert_rows"], preset["expert_hidden"], preset["expert_ffn"],
                            args.repeats, args.seed, devices)
        notes.append(f"experts: {preset['expert_rows']} rows, D={preset['expert_hidden']}, "
                     f"F={preset['expert_ffn']}, forward + backward; 'vs copy' holds the slot "
                     f"loop's time over each method's")
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        notes.append("fresh CPU buffers pay first-touch page faults; THP_MEM_ALLOC_ENABLE=1 "
                     "(torch's huge-page allocations) removes most of that cost")
    elapsed = time.perf_counter() - started

    info = machine_info(argv)
    info["threads_used"] = threads
    table = format_text(COLUMNS, _cells(rows))
    print()
    print(table)
    if share_rows:
        print()
        print(format_text(SHARE_COLUMNS, _share_cells(share_rows)))
    for line in notes:
        print(f"note: {line}")
    out = writable_dir(args.out, "--out")
    config = {k: getattr(args, k) for k in ("quick", "tokens", "hidden", "top_k", "slots",
                                            "repeats", "ranks", "dist_tokens", "dist_hidden",
                                            "seed")}
    config.update(sections=sections, wall_s=round(elapsed, 2))
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "config": config, "rows": [asdict(r) for r in rows],
         "shares": share_rows, "notes": notes},
        indent=2) + "\n", encoding="utf-8")
    md = ["# moebalance dispatch benchmark", "",
          f"- machine: {info['cpu']}, {info['cores']} cores; threads {threads}",
          f"- versions: python {info['python']}, torch {info['torch']}, numba {info['numba']}, "
          f"moebalance {info['moebalance']}",
          f"- command: {info['command']}", f"- date: {info['timestamp']}",
          f"- sizes: T={args.tokens}, D={args.hidden}, K={args.top_k}, S={args.slots}, float32; "
          f"median of {args.repeats} interleaved repeats", "",
          format_markdown(COLUMNS, _cells(rows)), "",
          "GB/s: bytes a method must move (permute 2*N*D, unpermute (N+T)*D, copy 2*N*D elements) "
          "over its time. 'vs copy': GB/s over the plain copy's (fresh buffers against clone, "
          "out= against copy_). GFLOP/s (experts section): the three GEMMs of forward and "
          "backward over the time; its 'vs copy' is the slot loop's time over each method's.",
          ""]
    if share_rows:
        md += ["Shares realised (4 gloo ranks):", "",
               format_markdown(SHARE_COLUMNS, _share_cells(share_rows)), ""]
    md += [f"- note: {x}" for x in notes]
    (out / "summary.md").write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench dispatch`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("dispatch", DESCRIPTION, add_arguments, run, argv)
