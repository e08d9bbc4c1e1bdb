"""One transformers MoE model trained four ways (plain, DDP, Lightning, HF Trainer), same losses.

A tiny fp64 Qwen3-MoE or Mixtral (8 experts, top-2, byte vocabulary) is wrapped with mb.wrap on 4
gloo ranks (speeds 1, 1, 0.5, 0.5; 3 slots each) and trained for --steps steps with a re-plan and
live migration every --every steps, by each of:

    plain      a hand-written loop: mb.wrap averages the dense gradients itself
    ddp        the same loop inside the user's DistributedDataParallel
    lightning  L.Trainer(devices=4, strategy="ddp") with RebalanceCallback
    hf         transformers.Trainer with RebalanceTrainerCallback (its own DDP under torchrun)

Every loop sees the same rows on each rank and the same optimizer (AdamW, constant rate, no
weight decay, clipping by the global norm). Printed per loop: the mean loss over the ranks at
each step, its largest relative difference from the first loop's, and a check that the
replicas of every expert are bit-identical across ranks. --json writes the losses; --compare
reads several such files (e.g. a spawned and a torchrun run) and prints the table.

    python examples/frameworks_agree.py --loops plain --json spawned.json
    torchrun --standalone --nproc-per-node 4 examples/frameworks_agree.py --json torchrun.json
    python examples/frameworks_agree.py --compare spawned.json torchrun.json

Needs transformers and accelerate, and Lightning for the lightning loop.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.integrations.wrap import unwrap_state_dict
from moebalance.lab.models import TextBatches, tiny_hf_moe
from moebalance.launch import launch, require_world_size, under_torchrun
from moebalance.nn.slots import moe_layers

TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])
SEQ, BATCH, LR = 32, 2, 3e-3


def build(family: str):
    model = tiny_hf_moe(family, experts=8, hidden=32, expert_hidden=32, seed=0).double()
    return mb.wrap(model, TOPOLOGY)


def mean_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def rows_for(world: int, rank: int, steps: int, order: str | None) -> list:
    """This rank's rows (order None) or every rank's, laid out for a framework's sharding:
    "batch" (batch i to rank i % world: accelerate), "row" (row i to rank i % world)."""
    streams = [TextBatches(SEQ, BATCH, world, r, seed=0) for r in range(world)]
    rows = []
    for step in range(steps):
        batches = [stream(step) for stream in streams]
        if order is None:
            rows += list(batches[rank])
        elif order == "batch":
            rows += [row for batch in batches for row in batch]
        else:
            rows += [batches[r][i] for i in range(BATCH) for r in range(world)]
    return rows


def hand_loop(rank, world, family, steps, every, use_ddp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(family)
    runner = DDP(model) if use_ddp else model       # wrap lists the experts in DDP's ignore list
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=every)
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    losses = []
    for step in range(steps):
        ids = data(step)
        loss = runner(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 1.0)
        optimizer.step()
        rebalancer.step()
        losses.append(mean_over_ranks(float(loss.detach())))
    rebalancer.finish()
    return losses, model, len(rebalancer.history)


def lightning_loop(rank, world, family, steps, every):
    import lightning as L

    from moebalance.integrations.lightning import RebalanceCallback

    if not under_torchrun():   # spawned ranks: Lightning joins them instead of starting its own
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("NODE_RANK", "0")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build(family)
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    module = Module()
    rebalance = RebalanceCallback(TOPOLOGY, every=every)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[rebalance])
    rows = rows_for(world, rank, steps, "row")
    sampler = torch.utils.data.DistributedSampler(rows, shuffle=False)
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler))
    losses = [mean_over_ranks(x) for x in module.losses]
    return losses, module.model, len(rebalance.rebalancer.history)


def hf_loop(rank, world, family, steps, every):
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback

    model = build(family)
    rebalance = RebalanceTrainerCallback(TOPOLOGY, every=every)
    local = []
    hook = model.register_forward_hook(lambda m, a, out: local.append(float(out.loss.detach())))
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0, optim="adamw_torch",
            weight_decay=0.0, lr_scheduler_type="constant", train_sampling_strategy="sequential",
            average_tokens_across_devices=False)
        # Under torchrun the Trainer shards what it is handed; spawned it does not.
        rows = rows_for(world, rank, steps, "batch" if args.world_size > 1 else None)
        trainer = transformers.Trainer(model=model, args=args, callbacks=[rebalance],
                                       train_dataset=[{"input_ids": r, "labels": r} for r in rows])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    hook.remove()
    return [mean_over_ranks(x) for x in local], model, len(rebalance.rebalancer.history)


def replicas_identical(model) -> bool:
    """Whether every expert's replicas hold bit-identical rows on every rank (collective)."""
    ok = True
    for layer in moe_layers(model):
        rows = {}
        for slot, expert in enumerate(layer.local_experts.tolist()):
            rows.setdefault(expert, []).append(
                torch.cat([p.detach()[slot].flatten() for p in layer.slot_parameters()]))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        seen = {}
        for held in everyone:
            for expert, copies in held.items():
                for values in copies:
                    ok &= torch.equal(seen.setdefault(expert, values), values)
    return ok


def worker(rank, world, family, loops, steps, every, path):
    require_world_size(world, TOPOLOGY.num_devices)
    how = "torchrun" if under_torchrun() else "spawned"
    results, reference = {}, None
    for name in loops:       # Lightning last: it leaves LOCAL_RANK set in spawned ranks
        if name in ("plain", "ddp"):
            losses, model, replans = hand_loop(rank, world, family, steps, every, name == "ddp")
        else:
            losses, model, replans = {"lightning": lightning_loop, "hf": hf_loop}[name](
                rank, world, family, steps, every)
        identical = replicas_identical(model)
        state = unwrap_state_dict(model)
        if reference is None:
            reference = state
        drift = max(float((state[k] - v).abs().max()) for k, v in reference.items()
                    if v.is_floating_point())
        results[f"{how} {name}"] = {"losses": losses, "replans": replans,
                                    "replicas_identical": identical, "weights_vs_first": drift}
    if rank == 0:
        print_table(results)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"family": family, "steps": steps, "every": every, "runs": results}, f,
                          indent=1)


def print_table(runs: dict) -> None:
    first = next(iter(runs.values()))["losses"]
    print(f"{'run':<20} {'step 0 loss':>14} {'last loss':>14} {'max rel diff':>13} re-plans "
          f"replicas identical  weights vs first (max abs)")
    for name, r in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], first))
        print(f"{name:<20} {r['losses'][0]:>14.10f} {r['losses'][-1]:>14.10f} {rel:>13.2e} "
              f"{r['replans']:>8} {str(r['replicas_identical']):>18}  {r['weights_vs_first']:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", help="qwen3_moe (default) or mixtral")
    parser.add_argument("--loops", default="plain,ddp,hf,lightning",
                        help="comma-separated: plain, ddp, hf, lightning (default all)")
    parser.add_argument("--steps", type=int, default=10, help="steps (default 10)")
    parser.add_argument("--every", type=int, default=5, help="re-plan every N steps (default 5)")
    parser.add_argument("--quick", action="store_true", help="4 steps, re-plan every 2")
    parser.add_argument("--json", default=None, help="write the losses here")
    parser.add_argument("--compare", nargs="+", default=None, help="print the table of these files")
    args = parser.parse_args()
    if args.compare:
        runs = {}
        for path in args.compare:
            with open(path, encoding="utf-8") as f:
                runs.update(json.load(f)["runs"])
        print_table(runs)
        return
    if args.quick:
        args.steps, args.every = 4, 2
    loops = [x for x in args.loops.split(",") if x]
    if not loops or any(x not in ("plain", "ddp", "hf", "lightning") for x in loops):
        parser.error("--loops takes plain, ddp, hf, lightning")
    loops = sorted(loops, key=["plain", "ddp", "hf", "lightning"].index)
    launch(worker, TOPOLOGY.num_devices,
           args=(args.family, loops, args.steps, args.every, args.json))


if __name__ == "__main__":
    main()
