"""``moebalance bench faults``: one rank's error against every rank, fault by fault (4 gloo ranks).

Each case injects one fault on one rank (rank 1) of an expert-parallel step and checks what
DESIGN.md's invariant 10 asks: every rank raises the same library error (same type, same
text, naming the faulty rank) within seconds, and the next good step still works and gives the
right output. Cases, by where the fault strikes:

* forward: rows of another dtype (the router fails), of another width, weights on another
  device, a router that returns out-of-range expert ids, a router that raises;
* combine: expert outputs with a row missing, experts that raise;
* backward: a failure inside the gradient-sync hook, a gradient of the wrong shape given to
  the manual gradient sync;
* migration: a transfer that fails, staged rows that do not fit at the commit, a placement
  that does not validate on one rank;
* re-split: the re-split tables failing to build on one rank;
* tracker snapshot: NaN loads on one rank, a tracker of another shape on one rank.

Figure per case: the time from the moment every rank starts the faulty call (after a
barrier) until the last rank raised. All cases run in one spawn of ``--ranks`` processes, with
a short collective timeout, so a case that hangs fails in seconds instead of after gloo's 30
minutes. :func:`run_matrix` is the runner the test suite calls at its small size.

Writes ``results.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

import numpy as np

from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, markdown_header

DESCRIPTION = "One rank's error reaches every rank: a fault matrix on 4 gloo ranks."

FAULTY = 1          # the rank every fault strikes
COLUMNS = ["fault", "where", "error on every rank", "same text", "s until every rank raised",
           "next step"]
SMALL = dict(hidden=8, ffn=16, experts=8, top_k=2, tokens=6)
FULL = dict(hidden=64, ffn=128, experts=16, top_k=2, tokens=256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the small layer the test suite uses (D=8, 8 experts, 6 tokens)")
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--timeout", type=positive_int_arg, default=20, metavar="S",
                        help="collective timeout in seconds: a case that hangs fails after it "
                             "(default 20)")
    parser.add_argument("--out", default=os.path.join("bench-out", "faults"), metavar="DIR",
                        help="folder for results.json and summary.md (default ./bench-out/faults)")


# -- the cases (run on every rank; each returns after checking the next good step) --------------


class _Setup:
    """What every case builds on: a topology, a placement with replicated experts, and a dense
    reference layer, identical on every rank."""

    def __init__(self, cfg: dict, rank: int, world: int) -> None:
        import torch

        import moebalance as mb
        from moebalance.nn.moe import DenseMoE

        self.cfg, self.rank, self.world = cfg, rank, world
        E = cfg["experts"]
        per = E // world
        # One spare slot per rank: some experts get replicas (built by hand: the planner's
        # first call compiles for minutes on ranks that share two cores).
        self.topology = mb.Topology.from_arrays(speed=[1.0] * world, slots=[per + 1] * world)
        self.placement = spare_placement(E, world, offset=0)
        self.moved = spare_placement(E, world, offset=1)
        self.dense = DenseMoE(cfg["hidden"], cfg["ffn"], E, cfg["top_k"], seed=7).double()
        gen = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(cfg["tokens"], cfg["hidden"], generator=gen, dtype=torch.float64)
        # One good step first: the dispatch kernels compile on first use (seconds), which would
        # otherwise count into the first case's time.
        self.check_step(self.layer())

    def layer(self, **options):
        from moebalance.nn.moe import ExpertParallelMoE

        return ExpertParallelMoE.from_dense(self.dense, self.placement, 0, **options)

    def check_step(self, moe) -> None:
        """A good forward and backward: outputs equal the dense layer's, replicas stay equal."""
        import torch

        out = moe(self.x)
        torch.testing.assert_close(out, self.dense(self.x), rtol=1e-10, atol=1e-12)
        out.square().sum().backward()
        if moe.grad_sync == "manual":
            moe.reduce_replica_gradients()
        moe.zero_grad()


def spare_placement(num_experts: int, world: int, offset: int):
    """Rank g holds experts g*P .. g*P + P - 1 (P = E / G) and a replica of expert
    ((g + 1) * P + offset) mod E, each replica with an equal share."""
    from moebalance.placement import Placement

    per = num_experts // world
    rows = [list(range(g * per, (g + 1) * per)) + [((g + 1) * per + offset) % num_experts]
            for g in range(world)]
    phy2log = np.array([sum(rows, [])], dtype=np.int64)
    share = 1.0 / np.bincount(phy2log[0], minlength=num_experts)[phy2log]
    slot_device = np.repeat(np.arange(world), per + 1)
    return Placement(phy2log, share, slot_device, num_experts).validate()


def _expect_raise(fn):
    """(exception, seconds from the common start) of ``fn()``; every rank starts together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.time()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the case reports what was raised
        return exc, start, time.time()
    return None, start, time.time()


def case_router_dtype(s: _Setup):
    """Rows of float32 into a float64 layer: the router's matmul fails on that rank."""
    moe = s.layer()
    x = s.x.float() if s.rank == FAULTY else s.x
    return _expect_raise(lambda: moe(x)), lambda: s.check_step(moe)


def case_rows_width(s: _Setup):
    moe = s.layer()
    x = s.x[:, :-1] if s.rank == FAULTY else s.x
    return _expect_raise(lambda: moe(x)), lambda: s.check_step(moe)


def case_weights_device(s: _Setup):
    """topk_weights on another device ("meta") than the rows, straight into the dispatcher."""
    moe = s.layer()
    _, w, ids = moe.router(s.x)
    if s.rank == FAULTY:
        w = w.to("meta")

    def dispatch():
        recv, handle = moe.dispatcher.dispatch(s.x, ids, w, moe.placement, 0)
        moe.dispatcher.combine(recv, handle)

    return _expect_raise(dispatch), lambda: s.check_step(moe)


def case_router_ids(s: _Setup):
    """The router's ids shifted out of [0, E) on one rank, once."""
    moe = s.layer()
    state = {"active": s.rank == FAULTY}

    def shift(module, args, out):
        if not state["active"]:
            return None
        state["active"] = False
        return out[0], out[1], out[2] + s.cfg["experts"]

    hook = moe.router.register_forward_hook(shift)
    result = _expect_raise(lambda: moe(s.x))
    hook.remove()
    return result, lambda: s.check_step(moe)


def case_router_raises(s: _Setup):
    moe = s.layer()

    def boom(module, args):
        raise RuntimeError("the router's pre-hook failed")

    hook = moe.router.register_forward_pre_hook(boom) if s.rank == FAULTY else None
    result = _expect_raise(lambda: moe(s.x))
    if hook is not None:
        hook.remove()
    return result, lambda: s.check_step(moe)


def case_combine_rows(s: _Setup):
    moe = s.layer()
    _, w, ids = moe.router(s.x)

    def step():
        recv, handle = moe.dispatcher.dispatch(s.x, ids, w, moe.placement, 0)
        y = moe.experts(recv, handle.tokens_per_local_slot)
        if s.rank == FAULTY:
            y = y[:-1]
        moe.dispatcher.combine(y, handle)

    return _expect_raise(step), lambda: s.check_step(moe)


def case_experts_raise(s: _Setup):
    moe = s.layer()

    def boom(module, args):
        raise RuntimeError("an expert failed")

    hook = moe.experts.register_forward_pre_hook(boom) if s.rank == FAULTY else None
    result = _expect_raise(lambda: moe(s.x))
    if hook is not None:
        hook.remove()
    return result, lambda: s.check_step(moe)


def case_backward_hook(s: _Setup):
    """The gradient-sync hook fails on one rank (its first exchange post raises)."""
    from moebalance.nn import grad_sync as replica_sync

    moe = s.layer()
    original = replica_sync.HolderExchange.post
    calls = {"n": 0}

    def failing_post(self, increment, kind, group):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the gradient exchange could not be posted")
        return original(self, increment, kind, group)

    if s.rank == FAULTY:
        replica_sync.HolderExchange.post = failing_post
    try:
        result = _expect_raise(lambda: moe(s.x).square().sum().backward())
    finally:
        replica_sync.HolderExchange.post = original
    moe.zero_grad()
    return result, lambda: s.check_step(moe)


def case_dispatch_backward(s: _Setup):
    """The dispatch's own backward (its weighted sum back to tokens) fails on one rank."""
    from moebalance.dispatch.kernels import kernels_for

    moe = s.layer()
    kernels = kernels_for("cpu")
    original = kernels.combine
    state = {"active": s.rank == FAULTY}

    def failing_combine(y, pos, weights, out=None):
        if weights is None and state["active"]:     # the backward's call (unit weights)
            state["active"] = False
            raise RuntimeError("the dispatch's backward failed")
        return original(y, pos, weights, out=out)

    kernels.combine = failing_combine
    x = s.x.clone().requires_grad_()      # the dispatch's backward runs for x's gradient
    try:
        result = _expect_raise(lambda: moe(x).square().sum().backward())
    finally:
        kernels.combine = original
    moe.zero_grad()
    return result, lambda: s.check_step(moe)


def case_manual_grad_shape(s: _Setup):
    """grad_sync="manual": one rank's slot gradient has the wrong shape."""
    moe = s.layer(grad_sync="manual")
    moe(s.x).square().sum().backward()
    if s.rank == FAULTY:
        # (``.grad = ...`` refuses another shape; ``.grad.data = ...`` does not.)
        moe.experts.down.grad.data = moe.experts.down.grad.data[:, :-1].clone()
    result = _expect_raise(moe.reduce_replica_gradients)
    moe.zero_grad()
    return result, lambda: s.check_step(moe)


def _migration_model(s: _Setup):
    import torch

    moe = s.layer()
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
    moe(s.x).square().sum().backward()
    optimizer.step()
    moe.zero_grad()
    return moe, optimizer, s.moved


def _migration_next(s: _Setup, moe, optimizer, new):
    def step():
        from moebalance import apply_placement

        apply_placement(moe, new, optimizer)
        s.check_step(moe)

    return step


def _migration_with_patch(s: _Setup, method: str, make_patch):
    """Apply a placement while the faulty rank's ``Migration.<method>`` is
    ``make_patch(original)``: every rank must raise, and the next good step must work."""
    from moebalance import apply_placement
    from moebalance.migrate.transfer import Migration

    moe, optimizer, new = _migration_model(s)
    original = getattr(Migration, method)
    if s.rank == FAULTY:
        setattr(Migration, method, make_patch(original))
    try:
        result = _expect_raise(lambda: apply_placement(moe, new, optimizer, timeout_s=5.0))
    finally:
        setattr(Migration, method, original)
    return result, _migration_next(s, moe, optimizer, new)


def case_migration_transfer(s: _Setup):
    def failing_issue(self, ops):
        raise RuntimeError("the transfer could not be posted")

    return _migration_with_patch(s, "_issue", lambda original: failing_issue)


def case_migration_commit(s: _Setup):
    """Staged rows that do not fit their slot tensor (another dtype) on one rank."""
    def misfit(original):
        def misfit_post(self, layer):
            transfer = original(self, layer)
            transfer.staged = [(t, local, rows.float()) for t, local, rows in transfer.staged]
            return transfer
        return misfit_post

    return _migration_with_patch(s, "_post", misfit)


def case_migration_bad_placement(s: _Setup):
    """One rank passes a placement of two layers where the layer's placement has one."""
    from moebalance import apply_placement
    from moebalance.placement import Placement

    moe, optimizer, new = _migration_model(s)
    bad = new
    if s.rank == FAULTY:
        bad = Placement(np.vstack([new.phy2log] * 2), np.vstack([new.share] * 2),
                        new.slot_device, new.num_experts)
    result = _expect_raise(lambda: apply_placement(moe, bad, optimizer))
    return result, _migration_next(s, moe, optimizer, new)


def case_resplit_tables(s: _Setup):
    """With the per-step re-split on, its tables fail to build on one rank."""
    from moebalance.dispatch import dispatcher as dispatcher_module

    moe = s.layer(resplit=True)
    original = dispatcher_module.resplit_plan

    def failing_plan(table, speeds, device):
        raise ValueError("the re-split tables could not be built")

    if s.rank == FAULTY:
        dispatcher_module.resplit_plan = failing_plan
    try:
        result = _expect_raise(lambda: moe(s.x))
    finally:
        dispatcher_module.resplit_plan = original
    return result, lambda: s.check_step(moe)


def _tracker(s: _Setup, experts: int):
    import torch

    from moebalance import LoadTracker

    tracker = LoadTracker(1, experts, ema=0.5)
    tracker.record(0, torch.arange(experts).view(-1, 1))
    tracker.step()
    return tracker


def _tracker_next(s: _Setup):
    def step():
        tracker = _tracker(s, s.cfg["experts"])
        loads = tracker.snapshot()
        assert np.array_equal(loads, np.full((1, s.cfg["experts"]), float(s.world))), loads

    return step


def case_tracker_nan(s: _Setup):
    tracker = _tracker(s, s.cfg["experts"])
    if s.rank == FAULTY:
        tracker._ema_LE[0, 0] = float("nan")
    return _expect_raise(tracker.snapshot), _tracker_next(s)


def case_tracker_shape(s: _Setup):
    E = s.cfg["experts"] + (1 if s.rank == FAULTY else 0)
    tracker = _tracker(s, E)
    return _expect_raise(tracker.snapshot), _tracker_next(s)


# (name, where, case)
CASES = [
    ("float32 rows into a float64 layer", "forward: router", case_router_dtype),
    ("rows one column short", "forward: input check", case_rows_width),
    ("topk_weights on another device", "forward: dispatch", case_weights_device),
    ("router ids out of range", "forward: dispatch", case_router_ids),
    ("router raises", "forward: router", case_router_raises),
    ("expert output one row short", "combine", case_combine_rows),
    ("experts raise", "combine: experts", case_experts_raise),
    ("gradient-sync hook fails", "backward: gradient sync", case_backward_hook),
    ("dispatch's backward fails", "backward: dispatch", case_dispatch_backward),
    ("manual sync, gradient of the wrong shape", "backward: manual sync", case_manual_grad_shape),
    ("transfer fails", "migration: stage", case_migration_transfer),
    ("staged rows do not fit", "migration: commit", case_migration_commit),
    ("placement of another shape", "migration: apply_placement", case_migration_bad_placement),
    ("re-split tables fail to build", "re-split", case_resplit_tables),
    ("NaN loads", "tracker snapshot", case_tracker_nan),
    ("tracker of another shape", "tracker snapshot", case_tracker_shape),
]


def _worker(rank: int, world: int, cfg: dict, result_dir: str) -> None:
    import torch.distributed as dist

    from moebalance.collective_errors import GroupError

    setup = _Setup(cfg, rank, world)
    results = {}
    path = os.path.join(result_dir, f"rank{rank}.json")
    for name, _, case in CASES:
        entry: dict = {}
        try:
            (error, start, end), next_step = case(setup)
            entry.update(start=start, end=end, raised=error is not None,
                         type=type(error).__name__ if error is not None else None,
                         message=str(error) if error is not None else None,
                         library=isinstance(error, GroupError),
                         ranks=getattr(error, "ranks", None))
            try:
                next_step()
                entry["next_ok"] = True
            except Exception:  # noqa: BLE001 - reported per case
                entry["next_ok"] = False
                entry["next_error"] = traceback.format_exc()
                raise
        except Exception:  # noqa: BLE001 - a case that breaks the group ends the run
            entry.setdefault("case_error", traceback.format_exc())
            results[name] = entry
            _write(path, results)
            raise
        results[name] = entry
        _write(path, results)
        dist.barrier()
    results["_agree_s"] = _agree_cost()
    _write(path, results)


def _agree_cost(repeats: int = 200) -> float:
    """Median seconds of one :func:`~moebalance.collective_errors.agree` that finds no failure
    (what the combine and the end of a backward pay on a good step)."""
    import torch.distributed as dist

    from moebalance.collective_errors import Attempt, agree

    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        agree(Attempt("timing"), None)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def _write(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f)
    os.replace(tmp, path)


def run_matrix(cfg: dict | None = None, *, ranks: int = 4, timeout_s: float = 20.0) -> dict:
    """Run every case on ``ranks`` spawned gloo ranks.

    Returns ``{"rows": [one dict per case], "agree_s": seconds}``: ``agree_s`` is the median
    time of one agreement that finds no failure (slowest rank). Each row: ``fault``, ``where``,
    ``per_rank`` (what each rank saw: type, message, library,
    ranks, start, end, next_ok, case_error), and the verdicts ``all_raised``, ``same_type``,
    ``same_text``, ``library``, ``names_faulty``, ``next_ok`` and ``seconds`` (last rank's raise
    minus the common start; None unless every rank raised).
    """
    from ...launch import launch

    cfg = dict(SMALL if cfg is None else cfg)
    with tempfile.TemporaryDirectory(prefix="moebalance-faults-") as tmp:
        failure = None
        try:
            launch(_worker, ranks, args=(cfg, tmp), timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the per-case files say where it stopped
            failure = f"{type(exc).__name__}: {exc}"
        per_rank = []
        for rank in range(ranks):
            path = os.path.join(tmp, f"rank{rank}.json")
            per_rank.append(json.loads(Path(path).read_text()) if os.path.exists(path) else {})
    rows = []
    for name, where, _ in CASES:
        seen = [results.get(name) for results in per_rank]
        row = dict(fault=name, where=where, per_rank=seen, spawn_error=failure)
        done = all(entry is not None and "case_error" not in entry for entry in seen)
        row["all_raised"] = done and all(entry["raised"] for entry in seen)
        row["same_type"] = row["all_raised"] and len({e["type"] for e in seen}) == 1
        row["same_text"] = row["all_raised"] and len({e["message"] for e in seen}) == 1
        row["library"] = row["all_raised"] and all(e["library"] for e in seen)
        row["names_faulty"] = row["all_raised"] and all(
            e["ranks"] is not None and FAULTY in e["ranks"] for e in seen)
        row["next_ok"] = done and all(e.get("next_ok") for e in seen)
        row["seconds"] = (max(e["end"] for e in seen) - min(e["start"] for e in seen)
                          if row["all_raised"] else None)
        row["type"] = seen[0]["type"] if row["same_type"] else None
        row["message"] = seen[0]["message"] if row["same_text"] else None
        rows.append(row)
    costs = [results["_agree_s"] for results in per_rank if "_agree_s" in results]
    return {"rows": rows, "agree_s": max(costs) if len(costs) == ranks else None}


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg = dict(SMALL if args.quick else FULL)
    if not 2 <= args.ranks <= cfg["experts"] // 2 or cfg["experts"] % args.ranks:
        raise UsageError(f"--ranks must be at least 2 (a fault on rank {FAULTY} against the "
                         f"others), divide the {cfg['experts']} experts and leave two per rank; "
                         f"got {args.ranks}")
    out = writable_dir(args.out, "--out")
    print(f"moebalance fault matrix: {len(CASES)} faults, each on rank {FAULTY} of {args.ranks} "
          f"gloo ranks; float64 layer D={cfg['hidden']} F={cfg['ffn']}, {cfg['experts']} experts, "
          f"top-{cfg['top_k']}, {cfg['tokens']} tokens per rank; collective timeout "
          f"{args.timeout} s (one spawn, about half a minute)", flush=True)
    started = time.perf_counter()
    matrix = run_matrix(cfg, ranks=args.ranks, timeout_s=args.timeout)
    rows = matrix["rows"]
    elapsed = time.perf_counter() - started
    cells = []
    for row in rows:
        cells.append([row["fault"], row["where"],
                      row["type"] if row["library"] else "NO (see results.json)",
                      "yes" if row["same_text"] else "no",
                      f"{row['seconds']:.3f}" if row["seconds"] is not None else "-",
                      "works" if row["next_ok"] else "FAILS"])
    table = format_text(COLUMNS, cells)
    agree_s = matrix["agree_s"]
    cost = ("-" if agree_s is None else f"{agree_s * 1e6:.0f} us")
    print()
    print(table)
    print(f"\ngood-path cost of one agreement (all-reduce of one int, median, slowest rank): "
          f"{cost}")
    info = machine_info(argv)
    (out / "results.json").write_text(json.dumps({"machine": info, "config": cfg, "rows": rows,
                                                  "agree_s": agree_s}, indent=2) + "\n",
                                                 encoding="utf-8")
    md = markdown_header("moebalance fault matrix", info) + [
        f"- each fault on rank {FAULTY} of {args.ranks} gloo ranks, one thread each; float64 "
        f"layer D={cfg['hidden']}, F={cfg['ffn']}, {cfg['experts']} experts, top-{cfg['top_k']}, "
        f"{cfg['tokens']} tokens per rank", "",
        format_markdown(COLUMNS, cells), "",
        "Seconds: from the moment every rank starts the faulty call (after a barrier) until the "
        "last rank raised. 'next step': the following good step gives the dense layer's output "
        "(and, after a migration fault, the same migration retried goes through).", "",
        f"Good-path cost of one agreement (one all-reduce of one int; the combine and the end of "
        f"each backward pay one): {cost} (median of 200, slowest rank)."]
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    good = all(row["library"] and row["same_text"] and row["next_ok"] for row in rows)
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0 if good else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench faults`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("faults", DESCRIPTION, add_arguments, run, argv)
