"""``moebalance bench wrap``: a wrapped transformers MoE model's training step, against one process.

A tiny Qwen3-MoE (``moebalance.lab.models.tiny_hf_moe``: 16 experts, top-2, byte vocabulary) trains
with AdamW on the standard library's source:

* single process: the global batch in one process, one thread (a rank of the run below has one
  thread too);
* wrapped: ``mb.wrap`` over ``--ranks`` gloo ranks, each its slice of the same global batch;
  step time of the slowest rank, ranks aligned by an untimed barrier before each step;
* transformers' own expert parallelism (``from_pretrained(..., distributed_config=
  DistributedConfig(fsdp_size=ranks, ep_size=ranks))``: experts sharded in contiguous blocks, the
  rest FSDP-sharded) on the same gloo ranks, where it runs; its error is reported where it does not.

Wrapper overhead: per step, the time the wrapped experts modules spend outside the dispatcher's
``dispatch`` / ``combine`` and the expert arithmetic (splitting rows by slot, joining results,
checking for a pending migration), measured by timers around those calls, as a share of the step.
Writes ``results.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

from ...cli.args import positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, markdown_header, phase, slowest

PROG = "moebalance bench wrap"  # the prefix of its progress lines

DESCRIPTION = "A wrapped transformers MoE model's training step on gloo ranks, against one process."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--family", default="qwen3_moe", help="model family (default qwen3_moe)")
    parser.add_argument("--hidden", type=positive_int_arg, default=128,
                        help="hidden size (default 128)")
    parser.add_argument("--seq", type=positive_int_arg, default=128,
                        help="sequence length (default 128)")
    parser.add_argument("--batch", type=positive_int_arg, default=4,
                        help="sequences per rank (default 4)")
    parser.add_argument("--out", default=os.path.join("bench-out", "wrap"), metavar="DIR",
                        help="folder for results.json and summary.md (default ./bench-out/wrap)")


def _build(cfg: dict):
    from ..models import tiny_hf_moe

    return tiny_hf_moe(cfg["family"], layers=2, experts=16, top_k=2, hidden=cfg["hidden"],
                       expert_hidden=2 * cfg["hidden"], seed=0)


def _batches(cfg: dict, world: int, rank: int):
    from ..models import TextBatches

    data = TextBatches(cfg["seq"], cfg["batch"], world, rank, seed=0)
    return lambda step: data(step)[:, :-1]


def _single(cfg: dict, world: int) -> list[float]:
    import torch

    torch.set_num_threads(1)
    model = _build(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    global_batch = _batches({**cfg, "batch": cfg["batch"] * world}, 1, 0)
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        ids = global_batch(step)
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    return times


class _Timers:
    """Seconds spent in the dispatcher and the expert arithmetic, and in the whole forward."""

    def __init__(self, layer) -> None:
        self.inner = 0.0
        self.total = 0.0
        dispatcher = layer.dispatcher
        for name in ("dispatch", "combine"):
            setattr(dispatcher, name, self._timed(getattr(dispatcher, name)))
        layer._expert = self._timed(layer._expert)
        forward = layer.forward

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.total += time.perf_counter() - start
            return out

        layer.forward = timed_forward

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.inner += time.perf_counter() - start
            return out
        return run


def _worker(rank: int, world: int, cfg: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    import moebalance as mb
    from moebalance.nn.slots import moe_layers

    topology = mb.Topology.uniform(num_devices=world, slots_per_device=-(-16 // world) + 1)
    model = mb.wrap(_build(cfg), topology, track=True)
    timers = [_Timers(layer) for layer in moe_layers(model)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches(cfg, world, rank)
    times, glue = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        ids = data(step)
        for t in timers:
            t.inner = t.total = 0.0
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= cfg["warmup"]:
            times.append(slowest(elapsed))
            glue.append(sum(t.total - t.inner for t in timers) / elapsed)
    everyone = [None] * world
    dist.all_gather_object(everyone, statistics.median(glue))

    # transformers' own expert parallelism on the same ranks, where it runs.
    hf_ep = {"ran": False}
    try:
        import transformers as tf

        # from_pretrained is the entry point that takes a distributed_config: save, then load.
        if rank == 0:
            phase(PROG, "wrapped model timed; now transformers' expert parallelism", cfg["t0"])
        box = [tempfile.mkdtemp(prefix="moebalance-hf-ep-") if rank == 0 else None]
        dist.broadcast_object_list(box, group_src=0)
        if rank == 0:
            _build(cfg).save_pretrained(box[0])
        dist.barrier()
        ep_model = tf.AutoModelForCausalLM.from_pretrained(
            box[0], distributed_config=tf.DistributedConfig(fsdp_size=world, ep_size=world))
        ep_opt = torch.optim.AdamW(ep_model.parameters(), lr=1e-3)
        ep_times = []
        for step in range(cfg["warmup"] + cfg["steps"]):
            ids = data(step)
            dist.barrier()
            start = time.perf_counter()
            ep_opt.zero_grad()
            ep_model(input_ids=ids, labels=ids).loss.backward()
            ep_opt.step()
            if step >= cfg["warmup"]:
                ep_times.append(slowest(time.perf_counter() - start))
        hf_ep = {"ran": True, "times": ep_times}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - reported, the benchmark goes on
        hf_ep = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    flags = [None] * world
    dist.all_gather_object(flags, hf_ep)
    if rank == 0:
        errors = [f.get("error") for f in flags if not f["ran"]]
        Path(result_path).write_text(json.dumps({
            "wrapped_s": times, "glue_share": everyone,
            "hf_ep": flags[0] if not errors else {"ran": False, "error": errors[0]}}),
            encoding="utf-8")


COLUMNS = ["setup", "step (ms, median)", "tokens/s", "vs one process"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    out = writable_dir(args.out, "--out")
    from ...launch import launch

    cfg = {"family": args.family, "hidden": args.hidden, "seq": args.seq, "batch": args.batch,
           "warmup": 2 if args.quick else 3, "steps": 4 if args.quick else 10}
    tokens = args.ranks * args.batch * args.seq
    print(f"moebalance wrap benchmark: tiny {args.family} (16 experts, top-2, H={args.hidden}), "
          f"{tokens} tokens per step, {args.ranks} gloo ranks", flush=True)
    started = time.perf_counter()
    cfg["t0"] = t0 = time.time()
    phase(PROG, f"one process: {cfg['warmup'] + cfg['steps']} training steps of the plain model",
          t0)
    single = _single(cfg, args.ranks)
    phase(PROG, f"spawning {args.ranks} gloo ranks: the wrapped model, then transformers' own "
                f"expert parallelism", t0)
    with tempfile.TemporaryDirectory(prefix="moebalance-wrap-") as tmp:
        path = os.path.join(tmp, "result.json")
        launch(_worker, args.ranks, args=(cfg, path))
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    elapsed = time.perf_counter() - started
    base = statistics.median(single)
    rows = [["one process, one thread", f"{base * 1e3:.1f}", f"{tokens / base:.0f}", "1.00x"]]
    wrapped = statistics.median(result["wrapped_s"])
    rows.append([f"moebalance wrap, {args.ranks} gloo ranks", f"{wrapped * 1e3:.1f}",
                 f"{tokens / wrapped:.0f}", f"{base / wrapped:.2f}x"])
    hf = result["hf_ep"]
    if hf["ran"]:
        t = statistics.median(hf["times"])
        rows.append([f"transformers fsdp_size=ep_size={args.ranks}, gloo", f"{t * 1e3:.1f}",
                     f"{tokens / t:.0f}", f"{base / t:.2f}x"])
    else:
        rows.append([f"transformers fsdp_size=ep_size={args.ranks}, gloo", "did not run", "", ""])
    glue = result["glue_share"]
    notes = ["wrapper overhead (experts module time outside dispatch, combine and expert "
             "arithmetic), share of the step per rank: "
             + ", ".join(f"{g:.1%}" for g in glue) + " (target < 10%)"]
    if not hf["ran"]:
        notes.append(f"transformers' expert parallelism on gloo: {hf['error']}")
    info = machine_info(argv)
    print()
    print(format_text(COLUMNS, rows))
    for line in notes:
        print(f"note: {line}")
    (out / "results.json").write_text(json.dumps({"machine": info, "config": cfg,
                                                  "single_s": single, "result": result},
                                                 indent=2) + "\n", encoding="utf-8")
    md = (markdown_header("moebalance wrap benchmark", info)
          + ["", format_markdown(COLUMNS, rows), ""] + [f"- {line}" for line in notes])
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench wrap`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("wrap", DESCRIPTION, add_arguments, run, argv)
