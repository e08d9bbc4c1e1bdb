"""``moebalance bench train``: what a live migration costs a training step, on 4 gloo ranks.

The small moebalance language model (:mod:`moebalance.lab.models`: 4 MoE layers of 16 experts,
AdamW) trains on the standard library's source on ``--ranks`` gloo ranks of unlike speed (1, 1,
0.5, 0.5, ...). Between stretches of ordinary steps, a new placement that moves at least
``--move-fraction`` of the slots is applied *without blocking* at a step boundary: its rows
(weights and both Adam moments) travel while the next step runs, and each layer commits them
right before its forward. Figures:

* step time (slowest rank, ranks aligned by a barrier before each timed step, barrier not
  timed): median of ordinary steps; each step during which a migration is in flight and
  commits, with the boundary's start cost (planning the transfers, packing, posting) counted in;
  their ratio to the median and the exposed time (migrating step minus median);
* bytes moved per re-plan and moves; the time of the same kind of migration run blocking (no
  compute beside it), per MB;
* replica gradient reduction: bytes each rank sends per step (holders only) against the dense
  all-reduce of every replicated expert, on a placement planned for the shipped router trace, where
  ranks hold different numbers of replicas; and, computed from the same exchange tables, for a
  DeepSeek-V3-sized placement (58 x 256 on 320 slots of 64 devices).

Writes ``results.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ..report import (
    format_markdown,
    format_text,
    machine_info,
    markdown_header,
    part_of,
    phase,
    slowest,
    timed,
)

PROG = "moebalance bench train"  # the prefix of its progress lines

DESCRIPTION = "What a live expert migration costs a training step (4 gloo ranks)."

FULL = dict(warmup=5, base_steps=8, trials=8)
QUICK = dict(warmup=2, base_steps=4, trials=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and trials (about a minute)")
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--hidden", type=positive_int_arg, default=128,
                        help="model width D (default 128)")
    parser.add_argument("--ffn", type=positive_int_arg, default=256,
                        help="expert hidden size F (default 256)")
    parser.add_argument("--slots", type=positive_int_arg, default=5,
                        help="expert slots per rank and layer (default 5; 16 experts per layer)")
    parser.add_argument("--seq", type=positive_int_arg, default=64,
                        help="sequence length (default 64)")
    parser.add_argument("--batch", type=positive_int_arg, default=8,
                        help="sequences per rank (default 8)")
    parser.add_argument("--move-fraction", type=float, default=0.05,
                        help="share of all slots each migration moves (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", default=os.path.join("bench-out", "train"), metavar="DIR",
                        help="folder for results.json and summary.md (default ./bench-out/train)")


def moved_placement(current, fraction: float, rng: np.random.Generator):
    """``current`` with single-replica experts swapped between devices until at least
    ``fraction`` of all slots (over all layers) hold another expert."""
    from ...placement import Placement

    phy2log = current.phy2log.copy()
    L, S = phy2log.shape
    target = int(np.ceil(fraction * L * S))
    moved = 0
    while moved < target:
        layer = int(rng.integers(L))
        row = phy2log[layer]
        counts = np.bincount(row, minlength=current.num_experts)
        a, b = rng.choice(S, 2, replace=False)
        da, db = current.slot_device[a], current.slot_device[b]
        ea, eb = row[a], row[b]
        if (da == db or counts[ea] > 1 or counts[eb] > 1
                or eb in row[current.slot_device == da] or ea in row[current.slot_device == db]):
            continue
        row[a], row[b] = eb, ea
        # a swap can undo an earlier one: count the copies the placement really needs
        moved = int(Placement(phy2log, current.share, current.slot_device,
                              current.num_experts).moves_from(current))
    return Placement(phy2log, current.share, current.slot_device, current.num_experts).validate()


def _worker(rank: int, world: int, cfg: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    import moebalance as mb
    from moebalance.lab.models import MoELanguageModel, TextBatches, lm_loss
    from moebalance.lab.workloads import trace_loads
    from moebalance.migrate.transfer import Migrator

    speeds = [1.0 if g < (world + 1) // 2 else 0.5 for g in range(world)]
    topology = mb.Topology.from_arrays(speed=speeds, slots=[cfg["slots"]] * world)
    loads = trace_loads("mixtral")[0].mean(axis=0)                # [4, 16] mean counts per step
    placement = mb.plan(loads, topology)
    model = MoELanguageModel(placement, hidden=cfg["hidden"], ffn=cfg["ffn"], experts=16, top_k=2,
                             layers=loads.shape[0], heads=4, seed=cfg["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TextBatches(cfg["seq"], cfg["batch"], world, rank, seed=cfg["seed"])
    tokens = world * cfg["batch"] * cfg["seq"]
    step_no = 0

    def train_step():
        nonlocal step_no
        batch = data(step_no)
        step_no += 1
        optimizer.zero_grad()
        lm_loss(model(batch[:, :-1]), batch[:, 1:], tokens).backward()
        optimizer.step()

    if rank == 0:
        phase(PROG, f"{cfg['warmup']} warm-up steps", cfg["t0"])
    for _ in range(cfg["warmup"]):
        train_step()
    if rank == 0:
        phase(PROG, f"{cfg['trials']} live migrations, each after {cfg['base_steps']} steps "
                    f"without one", cfg["t0"])
    # The migration connections are made once per job (the Rebalancer makes them when built).
    Migrator(None).transfer_group()
    rng = np.random.default_rng(cfg["seed"] + 7)
    base, migrating, starts, in_flight, reports = [], [], [], [], []
    for _ in range(cfg["trials"]):
        base += [timed(train_step) for _ in range(cfg["base_steps"])]
        new = moved_placement(mb.current_placement(model), cfg["move_fraction"], rng)
        dist.barrier()
        t0 = time.perf_counter()
        migration = mb.apply_placement(model, new, optimizer, topology=topology, blocking=False)
        start_cost = time.perf_counter() - t0
        train_step()
        steps = 1
        while not migration.done:                 # bounded bytes in flight would take more steps
            train_step()
            steps += 1
        migrating.append(slowest(time.perf_counter() - t0))
        starts.append(slowest(start_cost))
        in_flight.append(steps)
        reports.append(migration.report())
        assert migration.error is None, migration.error
    # The same kind of migration with nothing beside it, for time per MB.
    if rank == 0:
        phase(PROG, f"{cfg['trials']} blocking migrations (time per MB)", cfg["t0"])
    blocking = []
    for _ in range(cfg["trials"]):
        new = moved_placement(mb.current_placement(model), cfg["move_fraction"], rng)
        dist.barrier()
        t0 = time.perf_counter()
        migration = mb.apply_placement(model, new, optimizer, topology=topology, blocking=True)
        blocking.append((slowest(time.perf_counter() - t0), migration.plan.total_bytes,
                         migration.plan.num_moves))
    # Replica gradient traffic on the trace-planned placement (ranks hold unlike replica counts).
    mb.apply_placement(model, placement, optimizer, blocking=True)
    layer = model.blocks[0].moe
    row_bytes = sum(p[0].numel() * p.element_size()
                    for p in (layer.experts.gate_up, layer.experts.down))
    holders = [sum(block.moe.replica_sync_bytes() for block in model.blocks)]
    everyone = [None] * world
    dist.all_gather_object(everyone, holders[0])
    replicated = int(sum(np.count_nonzero(placement.replicas[layer_i] > 1)
                         for layer_i in range(placement.num_layers)))
    dense = 2 * (world - 1) / world * replicated * row_bytes
    replicas_held = [int(sum(np.count_nonzero(placement.replicas[l][
        placement.phy2log[l, placement.slot_device == g]] > 1)
        for l in range(placement.num_layers)))
        for g in range(world)]
    if rank == 0:
        result = {"base_s": base, "migrating_s": migrating, "start_s": starts,
                  "steps_in_flight": in_flight, "reports": reports, "blocking": blocking,
                  "sync_bytes_per_rank": everyone, "dense_bytes_per_rank": dense,
                  "replicas_held": replicas_held, "row_bytes": row_bytes,
                  "slots_total": int(placement.num_layers * placement.num_slots),
                  "speeds": speeds}
        Path(result_path).write_text(json.dumps(result), encoding="utf-8")


def sync_bytes_at_scale(row_bytes: int = 3 * 7168 * 2048 * 2) -> dict:
    """Replica gradient traffic per rank and step for a DeepSeek-V3-sized placement (computed,
    not timed): 58 layers x 256 experts planned onto 320 slots of 64 devices for the built-in
    moderate workload; one expert row is 3 x 7168 x 2048 bf16 elements."""
    import moebalance as mb
    from moebalance.lab.workloads import synthetic_loads
    from moebalance.nn.grad_sync import HolderExchange

    topology = mb.Topology.uniform(num_devices=64, slots_per_device=5, devices_per_node=8)
    placement = mb.plan(synthetic_loads("moderate", seed=0), topology)
    element_bytes = 2
    sent = np.zeros(64, dtype=np.int64)
    for layer in range(placement.num_layers):
        for g in range(64):
            exchange = HolderExchange(placement.phy2log[layer], placement.slot_device, g, 0)
            sent[g] += exchange.elements_sent(row_bytes // element_bytes) * element_bytes
    replicated = int((placement.replicas > 1).sum())
    dense = 2 * 63 / 64 * replicated * row_bytes
    return {"holder_max": int(sent.max()), "holder_median": float(np.median(sent)),
            "dense": dense, "replicated_experts": replicated}


COLUMNS = ["figure", "value", "target"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if not 0 < args.move_fraction <= 0.5:
        raise UsageError(f"--move-fraction must be in (0, 0.5], got {args.move_fraction}")
    if args.slots * args.ranks < 16:
        raise UsageError(f"--slots {args.slots} x --ranks {args.ranks} cannot hold 16 experts; "
                         f"give at least {-(-16 // args.ranks)} slots per rank")
    out = writable_dir(args.out, "--out")
    from ...launch import launch

    cfg = dict(QUICK if args.quick else FULL)
    cfg.update(hidden=args.hidden, ffn=args.ffn, slots=args.slots, seq=args.seq, batch=args.batch,
               move_fraction=args.move_fraction, seed=args.seed)
    print(f"moebalance train benchmark: {args.ranks} gloo ranks, 4 MoE layers x 16 experts, "
          f"D={args.hidden} F={args.ffn}, {args.slots} slots per rank, AdamW; "
          f"{cfg['trials']} migrations of >= {args.move_fraction:.0%} of the slots", flush=True)
    started = time.perf_counter()
    cfg["t0"] = time.time()
    phase(PROG, f"spawning {args.ranks} gloo ranks", cfg["t0"])
    with tempfile.TemporaryDirectory(prefix="moebalance-train-") as tmp:
        path = os.path.join(tmp, "result.json")
        launch(_worker, args.ranks, args=(cfg, path))
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    elapsed = time.perf_counter() - started

    median = statistics.median(result["base_s"])
    mig = result["migrating_s"]
    reports = result["reports"]
    moves = [r["moves"] for r in reports]
    mbytes = [r["bytes_total"] / 1e6 for r in reports]
    per_mb = [t / (b / 1e6) for t, b, _ in result["blocking"]]
    sync = result["sync_bytes_per_rank"]
    rows = [
        ["median step, no migration (ms)", f"{median * 1e3:.1f}", ""],
        ["step with a migration in flight and committing (ms, median / max)",
         f"{statistics.median(mig) * 1e3:.1f} / {max(mig) * 1e3:.1f}", ""],
        ["  ratio to the median step (median / max)",
         f"{statistics.median(mig) / median:.3f}x / {max(mig) / median:.3f}x", "<= 1.05x"],
        ["  exposed time (ms, median)", f"{(statistics.median(mig) - median) * 1e3:.1f}", ""],
        ["  start cost at the boundary (ms, median)",
         f"{statistics.median(result['start_s']) * 1e3:.1f}", ""],
        ["  steps until every layer committed", ",".join(map(str, result["steps_in_flight"])), ""],
        ["moves per re-plan (of all slots)",
         part_of(statistics.median(moves), result["slots_total"]), ">= 5%"],
        ["bytes moved per re-plan (MB, weights + Adam moments)",
         f"{statistics.median(mbytes):.2f}", ""],
        ["migration time per MB, blocking (ms/MB)", f"{statistics.median(per_mb) * 1e3:.2f}", ""],
        ["replica grad sync, bytes sent per rank per step (KB)",
         " / ".join(f"{b / 1e3:.0f}" for b in sync), ""],
        ["  replicated experts held per rank", " / ".join(map(str, result["replicas_held"])), ""],
        ["  dense all-reduce of every replicated expert (KB per rank)",
         f"{result['dense_bytes_per_rank'] / 1e3:.0f}", ""],
    ]
    scale = sync_bytes_at_scale()
    rows.append(["replica grad sync at DeepSeek-V3 size (GB per rank per step, bf16; max / median)",
                 f"{scale['holder_max'] / 1e9:.2f} / {scale['holder_median'] / 1e9:.2f}", ""])
    rows.append([f"  dense all-reduce of all {scale['replicated_experts']} replicated experts "
                 "(GB per rank)", f"{scale['dense'] / 1e9:.1f}", ""])
    result["at_scale"] = scale
    info = machine_info(argv)
    table = format_text(COLUMNS, rows)
    print()
    print(table)
    (out / "results.json").write_text(json.dumps({"machine": info, "config": cfg, "result": result},
                                                 indent=2) + "\n", encoding="utf-8")
    md = markdown_header("moebalance train benchmark", info) + [
          f"- {args.ranks} gloo ranks (speeds {result['speeds']}), one thread each; 4 MoE layers x "
          f"16 experts, D={args.hidden}, F={args.ffn}, {args.slots} slots per rank; AdamW", "",
          format_markdown(COLUMNS, rows), "",
          "Step times are the slowest rank's, ranks aligned by an untimed barrier before each "
          "step. A migrating step runs from the non-blocking apply_placement at the boundary to "
          "the end of the step in which the last layer committed."]
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench train`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("train", DESCRIPTION, add_arguments, run, argv)
