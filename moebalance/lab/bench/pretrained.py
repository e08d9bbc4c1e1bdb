"""``moebalance bench pretrained``: each rank's peak memory loading a checkpoint expert-parallel.

A Qwen3-MoE whose experts are nearly all of its parameters (default 4 layers x 64 experts,
hidden 512, expert hidden 1024, fp32: 1.6 GB) is written once with transformers'
``save_pretrained`` to a temporary folder, with the plain model's logits on a fixed batch. Then,
on ``--ranks`` gloo ranks, two separate runs load it under the same placement (planned for
uniform loads):

* ``mb.from_pretrained(path, topology)``: the model on the meta device, dense weights and this
  rank's expert rows read from the files;
* the whole model first: transformers' ``AutoModelForCausalLM.from_pretrained(path)`` on every
  rank, then ``mb.wrap(model, topology)``.

Per rank: the peak resident memory (``resource.getrusage`` ``ru_maxrss``, which counts pages of
the memory-mapped checkpoint that were read) above the rank's own level after its imports and
one load of a tiny checkpoint of the same family the same way (transformers imports model code
and loading machinery lazily, on first use), and the logits of its slice of the batch against
the plain model's.
Writes ``results.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

from ...cli.args import positive_int_arg, run_subcommand, writable_dir
from ..report import format_markdown, format_text, machine_info, markdown_header

DESCRIPTION = ("Peak memory per rank of mb.from_pretrained against building the whole model "
               "and wrapping it, on gloo ranks.")
BATCH, SEQ = 2, 32     # sequences per rank, tokens per sequence of the logits check
LIMIT = 0.40           # from_pretrained's peak over the whole-model path's, per rank


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small model (2 layers x 16 experts, hidden 128) in seconds")
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--layers", type=positive_int_arg, default=4, help="MoE layers (default 4)")
    parser.add_argument("--experts", type=positive_int_arg, default=64, help="experts (default 64)")
    parser.add_argument("--hidden", type=positive_int_arg, default=512,
                        help="hidden size (default 512)")
    parser.add_argument("--expert-hidden", type=positive_int_arg, default=1024,
                        help="expert hidden size (default 1024)")
    parser.add_argument("--out", default=os.path.join("bench-out", "pretrained"), metavar="DIR",
                        help="folder for results.json and summary.md "
                             "(default ./bench-out/pretrained)")


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def _write_checkpoint(cfg: dict, folder: str) -> None:
    """Build the model, save it, and store the plain model's logits (run in its own process)."""
    import torch

    from ..models import tiny_hf_moe

    torch.set_num_threads(1)
    model = tiny_hf_moe("qwen3_moe", layers=cfg["layers"], experts=cfg["experts"], top_k=2,
                        hidden=cfg["hidden"], expert_hidden=cfg["expert_hidden"], seed=0)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    model.save_pretrained(os.path.join(folder, "model"))
    # A tiny one of the same family: each rank loads it both ways before its baseline, so
    # the baseline includes the imports and one-time set-up both paths need.
    tiny_hf_moe("qwen3_moe", layers=1, experts=8, hidden=32, expert_hidden=32,
                seed=0).save_pretrained(os.path.join(folder, "warmup"))
    ids = torch.randint(0, model.config.vocab_size, (cfg["ranks"] * BATCH, SEQ),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    torch.save({"ids": ids, "logits": logits, "expert_params": experts, "params": total,
                "bytes": sum(p.numel() * p.element_size() for p in model.parameters())},
               os.path.join(folder, "reference.pt"))


def _worker(rank: int, world: int, folder: str, mode: str, num_experts: int,
            result_path: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf

    import moebalance as mb
    from moebalance.nn.slots import moe_layers

    reference = torch.load(os.path.join(folder, "reference.pt"))
    ids = reference["ids"][rank * BATCH:(rank + 1) * BATCH]
    expected = reference["logits"][rank * BATCH:(rank + 1) * BATCH]
    del reference
    def load(name: str, experts: int):
        path = os.path.join(folder, name)
        topology = mb.Topology.uniform(num_devices=world, slots_per_device=-(-experts // world) + 1)
        if mode == "from_pretrained":
            return mb.from_pretrained(path, topology)
        return mb.wrap(tf.AutoModelForCausalLM.from_pretrained(path), topology)

    warm = load("warmup", 8)
    del warm
    gc.collect()
    dist.barrier()
    baseline = _peak_mb()
    start = time.perf_counter()
    model = load("model", num_experts)
    seconds = time.perf_counter() - start
    peak = _peak_mb()
    slot_bytes = sum(p.numel() * p.element_size() for layer in moe_layers(model)
                     for p in layer.slot_parameters())
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    diff = float((logits - expected).abs().max())
    scale = float(expected.abs().max())
    row = {"rank": rank, "baseline_mb": baseline, "peak_mb": peak, "added_mb": peak - baseline,
           "held_mb": held / 2**20, "slot_mb": slot_bytes / 2**20, "seconds": seconds,
           "max_abs_diff": diff, "max_abs_logit": scale}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows), encoding="utf-8")


COLUMNS = ["rank", "from_pretrained peak (MB)", "whole model + wrap peak (MB)", "ratio",
           "held after (MB)", "logits max |diff|"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    out = writable_dir(args.out, "--out")
    import torch

    from ...launch import launch

    if args.quick:
        cfg = {"layers": 2, "experts": 16, "hidden": 128, "expert_hidden": 256}
    else:
        cfg = {"layers": args.layers, "experts": args.experts, "hidden": args.hidden,
               "expert_hidden": args.expert_hidden}
    cfg["ranks"] = args.ranks
    started = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="moebalance-pretrained-")
    try:
        # The checkpoint is written by a process of its own, so this one never holds the model.
        writer = mp.get_context("spawn").Process(target=_write_checkpoint, args=(cfg, folder))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise RuntimeError(f"writing the checkpoint failed (exit code {writer.exitcode})")
        info = {k: v for k, v in torch.load(os.path.join(folder, "reference.pt")).items()
                if k in ("expert_params", "params", "bytes")}
        print(f"moebalance pretrained benchmark: Qwen3-MoE {cfg['layers']} layers x "
              f"{cfg['experts']} experts, hidden {cfg['hidden']}, expert hidden "
              f"{cfg['expert_hidden']}, fp32: {info['bytes'] / 2**30:.2f} GiB, experts "
              f"{info['expert_params'] / info['params']:.1%} of parameters; "
              f"{args.ranks} gloo ranks",
              flush=True)
        results = {}
        for mode in ("from_pretrained", "whole_then_wrap"):
            path = os.path.join(folder, f"{mode}.json")
            launch(_worker, args.ranks, args=(folder, mode, cfg["experts"], path))
            results[mode] = json.loads(Path(path).read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - started
    rows, ratios = [], []
    for ours, whole in zip(results["from_pretrained"], results["whole_then_wrap"]):
        if whole["added_mb"] <= 0:
            # ru_maxrss is the process's lifetime peak: a rank that had been higher before
            # (a reused process) shows no rise at all
            raise RuntimeError(f"rank {whole['rank']}'s peak memory did not rise while it loaded "
                               f"the whole model, so there is nothing to compare against; run "
                               f"'moebalance bench pretrained' in a fresh process")
        ratio = ours["added_mb"] / whole["added_mb"]
        ratios.append(ratio)
        rows.append([str(ours["rank"]), f"{ours['added_mb']:.0f}", f"{whole['added_mb']:.0f}",
                     f"{ratio:.2f}", f"{ours['held_mb']:.0f}",
                     f"{max(ours['max_abs_diff'], whole['max_abs_diff']):.1e}"])
    worst = max(r["max_abs_diff"] for mode in results.values() for r in mode)
    scale = max(r["max_abs_logit"] for mode in results.values() for r in mode)
    notes = ["peak resident memory above each rank's level after imports and a tiny warm-up "
             "load (ru_maxrss); held "
             "after = parameter bytes of the loaded model on that rank (dense + its slots)",
             f"largest ratio {max(ratios):.2f} (target <= {LIMIT:.2f}): "
             + ("met" if max(ratios) <= LIMIT else "NOT met"),
             f"logits against the plain model, both runs: max |diff| {worst:.1e} "
             f"(max |logit| {scale:.1f})"]
    machine = machine_info(argv)
    print()
    print(format_text(COLUMNS, rows))
    for line in notes:
        print(f"note: {line}")
    (out / "results.json").write_text(json.dumps({"machine": machine, "config": cfg, "model": info,
                                                  "results": results}, indent=2) + "\n",
                                      encoding="utf-8")
    md = (markdown_header("moebalance pretrained benchmark", machine)
          + ["", format_markdown(COLUMNS, rows), ""] + [f"- {line}" for line in notes])
    (out / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'} ({elapsed:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``moebalance bench pretrained`` as a function; ``argv`` excludes the program name."""
    return run_subcommand("pretrained", DESCRIPTION, add_arguments, run, argv)
