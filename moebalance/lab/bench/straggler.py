"""``moebalance bench straggler``: measured device speeds, and re-planning when a rank slows down.

On ``--ranks`` gloo ranks (4), each rank's expert arithmetic held to a fraction of a core by
:class:`~moebalance.lab.bench.simcheck.CoreShare` (the way ``bench simcheck`` gives a rank a
device speed):

1. **Topology.measure**: ranks held to 1.0 / 1.0 / 0.5 / 0.5 of a core (the pattern repeats on
   more ranks) measure the topology of a layer; the relative speeds against those ratios, and
   the call's wall time.
2. **Straggler**: a stack of :class:`~moebalance.nn.moe.ExpertParallelMoE` layers trains on
   balanced routing (a :class:`~moebalance.lab.bench.simcheck.TraceRouter` on equal counts, so
   there is nothing to re-balance but the speeds), every rank held to its share of the cores;
   at step ``--slow-at`` the last rank's hold drops to ``--slow`` times its share. One run keeps
   the original topology; the other has a ``Rebalancer(speeds=SpeedTracker(...))`` that follows
   the measured speeds. The two train side by side in the same ranks, a step of each in turn,
   so that a spell of a slower host falls on both. Figures: the mean step time (slowest
   rank, ranks aligned by an untimed barrier) over the last third of the steps, their ratio,
   whether the losses are equal, and the re-plans the tracker triggered.

Writes ``results.json`` and ``summary.md`` under ``--out``.
Legend: G ranks, E experts, N tokens per rank, D hidden size, F expert hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ...cli.args import UsageError, positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, markdown_header

DESCRIPTION = "Measured device speeds, and re-planning away from a straggler (4 gloo ranks)."

# measure_repeats: rounds of Topology.measure (one 20 ms repeat per rank each); 24 spread each
# rank's repeats over about 3 s, longer than the slow spells of one process on a shared host.
# min_change 0.1: a rank given fewer rows runs them slower per row (each expert call has a cost
# of its own), so the speed measured after the first re-plan is lower again (0.5 -> about
# 0.42 here); a second re-plan for it needs the noise gate below that 16% change
# D=256, F=2048: expert arithmetic is 55% of a rank's CPU in a step (45% at D=128, F=1024,
# where the dispatch, the optimizer and gloo's threads weigh as much as the experts), nearer the
# share expert GEMMs take in the MoE models this is for; 256 measuring tokens keep a repeat at
# the cost of 1024 at that smaller shape.
FULL = dict(hidden=256, ffn=2048, tokens=512, experts=8, slots=3, layers=2, steps=60, slow_at=20,
            every=5, measure_tokens=256, measure_repeats=24, min_change=0.1)
# --quick: the same layers at half the tokens, half the steps (a D=64 layer's experts weighed too
# little for a straggler to slow the step at all)
QUICK = dict(FULL, tokens=256, steps=30, slow_at=10, measure_repeats=16)
MEASURE_SHARES = (1.0, 1.0, 0.5, 0.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="half the tokens and steps (about 45 s)")
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--steps", type=positive_int_arg, default=None,
                        help=f"training steps (default {FULL['steps']}, quick {QUICK['steps']})")
    parser.add_argument("--slow-at", type=positive_int_arg, default=None,
                        help=f"step at which the last rank slows (default {FULL['slow_at']})")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="the straggler's speed as a fraction of the others' (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", default=os.path.join("bench-out", "straggler"), metavar="DIR",
                        help="folder for results.json and summary.md "
                             "(default ./bench-out/straggler)")


# -- on every rank --------------------------------------------------------------------------------


def _layers(cfg: dict, rank: int, world: int, placement, share):
    import torch

    from ...nn.moe import ExpertParallelMoE
    from .simcheck import TraceRouter, _Stack

    equal_TE = np.ones((cfg["steps"], cfg["experts"]))
    layers = []
    for layer in range(cfg["layers"]):
        router = TraceRouter(cfg["hidden"], equal_TE, 2, cfg["tokens"], rank=rank,
                             world_size=world, seed=cfg["seed"] * 131 + layer)
        moe = ExpertParallelMoE(cfg["hidden"], cfg["ffn"], cfg["experts"], 2, placement,
                                layer=layer, router=router, seed=cfg["seed"] * 131 + layer,
                                exchange="all_to_all")
        if share is not None:
            share.attach(moe.experts)
        layers.append(moe)
    return _Stack(layers).to(torch.float64 if cfg.get("float64") else torch.float32)


def start_placement(cfg: dict, world: int):
    """The first placement: planned for equal loads on equal devices."""
    import moebalance as mb

    topology = mb.Topology.uniform(world, cfg["slots"])
    return topology, mb.plan(np.ones((cfg["layers"], cfg["experts"])), topology)


class _Run:
    """One training run of :func:`straggler_pair` on this rank: its layers, optimizer, data,
    its own core hold, and (``track``) the Rebalancer that follows the measured speeds.

    Args:
        cfg: hidden, ffn, tokens, experts, slots, layers, steps, slow_at, slow, every, seed,
            share (every rank's hold, a fraction of a core; None: no hold, the straggler then
            held to ``slow``), float64, min_change and window (optional).
        track: follow the measured speeds (a Rebalancer with a SpeedTracker) or keep the
            original topology.
    """

    def __init__(self, cfg: dict, track: bool) -> None:
        import torch
        import torch.distributed as dist

        import moebalance as mb

        from .simcheck import CoreShare

        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        base = cfg.get("share")
        self.base = base if base is not None else 1.0
        self.share = CoreShare(self.base)
        self.slow_rank = self.world - 1
        self.topology, placement = start_placement(cfg, self.world)
        torch.manual_seed(cfg["seed"])
        self.model = _layers(cfg, self.rank, self.world, placement, self.share)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.rebalancer = None
        if track:
            speeds = mb.SpeedTracker(every=cfg["every"], min_change=cfg.get("min_change", 0.2),
                                     window=cfg.get("window", 3))
            self.rebalancer = mb.Rebalancer(self.model, self.topology, self.optimizer,
                                            every=None, speeds=speeds)
        gen = torch.Generator().manual_seed(cfg["seed"] * 7 + self.rank)
        dtype = next(self.model.parameters()).dtype
        shape = (cfg["steps"], cfg["tokens"], cfg["hidden"])
        self.x_TND = torch.randn(*shape, generator=gen).to(dtype)
        self.y_TND = torch.randn(*shape, generator=gen).to(dtype)
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.before = _slow_share(self.model, self.topology, self.slow_rank)

    def _train(self, t: int) -> None:
        import torch.distributed as dist

        for moe in self.model.layers:
            moe.router.step = t
        self.optimizer.zero_grad()
        # the input needs a gradient, as a transformer's MoE layers' inputs do (and CoreShare
        # ends each backward window at it)
        x_ND = self.x_TND[t].detach().requires_grad_()
        loss = (self.model(x_ND) - self.y_TND[t]).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        if self.rebalancer is not None:
            self.rebalancer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        self.losses.append(float(total) / self.world)

    def step(self, t: int) -> None:
        """Train step ``t`` and time it (slowest rank, aligned by an untimed barrier); the
        straggler's hold drops at ``cfg['slow_at']``."""
        from ..report import timed

        if t == self.cfg["slow_at"] and self.rank == self.slow_rank:
            self.share.share = self.base * self.cfg["slow"]
        self.step_s.append(timed(lambda: self._train(t)))

    def result(self) -> dict:
        r = self.rebalancer
        if r is not None:
            r.finish()
        return {"step_s": self.step_s, "losses": self.losses,
                "history": [] if r is None else r.history,
                "decisions": [] if r is None else r.speeds.decisions,
                "resplit_speeds": [list(moe.dispatcher.speeds or ()) for moe in self.model.layers],
                "topology_speed": (self.topology if r is None else r.topology).speed.tolist(),
                "slow_rank_share_before": self.before,
                "slow_rank_share_after": _slow_share(self.model, self.topology, self.slow_rank)}


def straggler_pair(cfg: dict) -> dict[str, dict]:
    """Train ``cfg['steps']`` steps (see :class:`_Run`) with the fixed topology and with speed
    tracking, side by side on every rank of the default group: step t of one, then step t of
    the other, the first of the two alternating, so that both meet the same spells of the
    host's speed. The last rank's hold drops to ``cfg['slow']`` of the others' at step
    ``cfg['slow_at']``.

    Returns (the same on every rank) per run name ("fixed topology", "speed tracking"):
    ``step_s`` [steps], ``losses`` [steps], ``history`` (the Rebalancer's re-plans),
    ``decisions`` (the tracker's), ``resplit_speeds`` (the speeds each layer's re-split uses at
    the end), ``topology_speed`` (the topology's at the end), ``slow_rank_share_before`` and
    ``_after`` (fraction of the tokens the slow rank's slots receive, first layer).
    """
    runs = {"fixed topology": _Run(cfg, False), "speed tracking": _Run(cfg, True)}
    order = list(runs.values())
    for t in range(cfg["steps"]):
        for run in order if t % 2 == 0 else order[::-1]:
            run.step(t)
    return {name: run.result() for name, run in runs.items()}


def _slow_share(model, topology, slow_rank: int) -> float:
    """Fraction of layer 0's (equal) expert loads the slow rank's slots receive."""
    from ...nn.slots import current_placement

    p = current_placement(model)
    device_GL = p.device_loads(np.ones((p.num_layers, p.num_experts)))
    return float(device_GL[0, slow_rank] / device_GL[0].sum())


def measure_run(cfg: dict) -> dict:
    """``Topology.measure`` on every rank, rank g held to ``MEASURE_SHARES[g % 4]`` of a core."""
    import torch.distributed as dist

    import moebalance as mb

    from .simcheck import CoreShare

    rank, world = dist.get_rank(), dist.get_world_size()
    _, placement = start_placement(cfg, world)
    model = _layers(cfg, rank, world, placement, None)
    layer = model.layers[0]
    CoreShare(MEASURE_SHARES[rank % len(MEASURE_SHARES)]).attach(layer.experts)
    dist.barrier()
    start = time.perf_counter()
    topology = mb.Topology.measure(layer=layer, tokens=cfg["measure_tokens"],
                                   repeats=cfg["measure_repeats"], num_experts=cfg["experts"],
                                   num_layers=cfg["layers"])
    seconds = time.perf_counter() - start
    return {"topology": topology.to_dict(), "seconds": seconds}


def _worker(rank: int, world: int, cfg: dict, result_path: str) -> None:
    from .simcheck import steady_allocator

    steady_allocator()
    measured = measure_run(cfg)
    runs = straggler_pair(cfg)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"measure": measured, "runs": runs}),
                                     encoding="utf-8")


# -- the command ----------------------------------------------------------------------------------


COLUMNS = ["run", "mean step ms (before)", "mean step ms (last third)", "re-plans",
           "slow rank's token share before / after"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ...launch import launch

    cfg = dict(QUICK if args.quick else FULL)
    for name in ("steps", "slow_at"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    if not 0 < args.slow < 1:
        raise UsageError(f"--slow must be a fraction in (0, 1), got {args.slow!r}")
    if cfg["slow_at"] >= cfg["steps"]:
        raise UsageError(f"--slow-at {cfg['slow_at']} must come before --steps {cfg['steps']}")
    if args.ranks < 2:
        raise UsageError(f"--ranks must be >= 2, got {args.ranks}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cfg.update(slow=args.slow, seed=args.seed, ranks=args.ranks, cores=int(cores),
               share=min(1.0, cores / args.ranks))
    out = writable_dir(args.out, "--out")
    print(f"moebalance straggler: {cfg['ranks']} gloo ranks on {cfg['cores']} cores, each held to "
          f"{cfg['share']:.2f} of a core; rank {cfg['ranks'] - 1} slows to {cfg['slow']} of that "
          f"at step {cfg['slow_at']} of {cfg['steps']}; {cfg['layers']} layers x {cfg['experts']} "
          f"experts top-2, D={cfg['hidden']} F={cfg['ffn']}, {cfg['tokens']} tokens per rank",
          flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moebalance-straggler-") as tmp:
        path = os.path.join(tmp, "result.json")
        launch(_worker, cfg["ranks"], args=(cfg, path))
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    elapsed = time.perf_counter() - started

    m = result["measure"]
    expected = np.array([MEASURE_SHARES[g % 4] for g in range(cfg["ranks"])])
    speed = np.array(m["topology"]["speed"])
    error = np.abs((speed / speed.max()) / (expected / expected.max()) - 1)
    measure_lines = [
        f"Topology.measure, ranks held to {' / '.join(f'{s:g}' for s in expected)} of a core: "
        f"speeds {' / '.join(f'{s:.3f}' for s in speed)} (spread "
        f"{' / '.join(f'{s:.3f}' for s in m['topology']['speed_spread'])}), largest error "
        f"{error.max():.1%}, {m['seconds']:.2f} s"]
    last = cfg["steps"] - cfg["steps"] // 3
    rows, means = [], {}
    for name, r in result["runs"].items():
        step_s = np.array(r["step_s"])
        means[name] = float(step_s[last:].mean())
        rows.append([name, f"{step_s[2:cfg['slow_at']].mean() * 1e3:.1f}",
                     f"{means[name] * 1e3:.1f}", str(len(r["history"])),
                     f"{r['slow_rank_share_before']:.3f} / {r['slow_rank_share_after']:.3f}"])
    fixed, tracked = result["runs"]["fixed topology"], result["runs"]["speed tracking"]
    ratio = means["fixed topology"] / means["speed tracking"]
    equal = bool(np.allclose(fixed["losses"], tracked["losses"], rtol=1e-5, atol=1e-7))
    verdict = [f"steps {last}..{cfg['steps'] - 1}: speed tracking {ratio:.2f}x faster than the "
               f"fixed topology; losses equal (rtol 1e-5): {'yes' if equal else 'NO'}"]
    verdict += [f"re-plan at step {h['step']}: speeds {np.round(h.get('speeds', []), 3).tolist()}, "
                f"{h['moves']} moves, migration {h['migration_s'] or 0:.3f} s"
                for h in tracked["history"]]
    info = machine_info(argv)
    table = format_text(COLUMNS, rows)
    print("\n".join(measure_lines))
    print()
    print(table)
    print()
    print("\n".join(verdict))
    (out / "results.json").write_text(json.dumps(
        {"machine": info, "config": cfg, "measure": m, "measure_error": error.tolist(),
         "runs": result["runs"], "ratio_last_third": ratio, "losses_equal": equal,
         "wall_s": elapsed}, indent=2) + "\n", encoding="utf-8")
    md = markdown_header("moebalance straggler: measured speeds and re-planning", info) + [
        f"- {cfg['ranks']} gloo ranks on {cfg['cores']} cores, one torch thread each",
        *[f"- {line}" for line in measure_lines],
        f"- straggler: {cfg['layers']} ExpertParallelMoE layers x {cfg['experts']} experts, "
        f"top-2, D={cfg['hidden']}, F={cfg['ffn']}, {cfg['tokens']} tokens per rank, fp32, "
        f"AdamW, balanced routing; every rank held to {cfg['share']:.2f} of a core, rank "
        f"{cfg['ranks'] - 1} to {cfg['slow']} of that from step {cfg['slow_at']}", "",
        format_markdown(COLUMNS, rows), "", *[f"- {v}" for v in verdict]]
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench straggler`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("straggler", DESCRIPTION, add_arguments, run, argv)
