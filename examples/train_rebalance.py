"""Train a small MoE language model on 4 gloo ranks of unlike speed, rebalancing it live.

The model (moebalance.lab.models.MoELanguageModel: 2 attention + MoE blocks, 8 experts, top-2) reads
bytes of the Python standard library's source. The devices have speeds 1, 1, 0.5, 0.5 and 3
expert slots each. Every --every steps a Rebalancer re-plans from the tracked loads (moving few
experts) and migrates weights and AdamW state beside the next step. Printed: loss and the
imbalance of each step's own loads under the placement in force; written: a plot of both.

    python examples/train_rebalance.py [--steps 60] [--every 15] [--loop plain|ddp|lightning|hf]
    torchrun --standalone --nproc-per-node 4 examples/train_rebalance.py [--loop ...]

Loops: plain (moebalance averages the dense gradients itself), ddp (the model inside the user's
DistributedDataParallel, its experts excluded with mb.exclude_experts_from_ddp), lightning
(L.Trainer(devices=4, strategy="ddp") with RebalanceCallback), hf (the Hugging Face Trainer,
whose own DDP runs under torchrun). Every loop trains on the same rows and prints the same losses,
spawned or under torchrun. --loop lightning needs Lightning 2.x, --loop hf needs transformers and
accelerate.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.frameworks import active_ddp
from moebalance.lab.models import MoELanguageModel, TextBatches, lm_loss
from moebalance.launch import launch, require_world_size, under_torchrun
from moebalance.nn.checkpoint import expert_state_dict
from moebalance.nn.slots import moe_layers

from _step_imbalance import bought

TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])
EXPERTS, LAYERS, SEQ, BATCH = 8, 2, 64, 8


def train_loss(logits, targets, world: int, under_ddp: bool):
    """(loss to backpropagate, this rank's share of the global mean loss) of one step.

    Each rank's cross entropy is summed over its tokens. Without DDP, moebalance sums the
    gradients over the ranks: divide by the global token count. A DDP around the model averages
    them: divide by this rank's token count (the per-rank mean DDP expects). Same gradients.
    """
    share = lm_loss(logits, targets, world * targets.numel())
    return (share * world if under_ddp else share), share.detach()


def build():
    placement = mb.plan(np.ones((LAYERS, EXPERTS)), TOPOLOGY)   # first guess: uniform loads
    return MoELanguageModel(placement, hidden=64, ffn=128, experts=EXPERTS, top_k=2,
                            layers=LAYERS, heads=4, seed=0, moe_options={"nodes": TOPOLOGY.node})


class StepLog:
    """Each step's loss and the imbalance of that step's loads under the placement in force,
    re-split over its replicas as the dispatcher does."""

    def __init__(self, model, world: int) -> None:
        self.model, self.world, self.rows = model, world, []
        self.last = time.perf_counter()

    def record(self, step: int, loss: torch.Tensor, rebalancer) -> None:
        counts = rebalancer.last_counts.to(torch.float64)
        total = torch.cat([counts.flatten(), loss.detach().double().view(1)])
        dist.all_reduce(total)
        loads = total[:-1].view_as(counts).numpy()
        placement = mb.current_placement(self.model)
        imbalance = mb.step_imbalance(loads[None], placement, TOPOLOGY)[0]
        replanned = bool(rebalancer.history) and rebalancer.history[-1]["step"] == rebalancer.steps
        now = time.perf_counter()
        self.rows.append({"step": step, "loss": float(total[-1]), "imbalance": float(imbalance),
                          "replan": replanned, "step_s": now - self.last})
        self.last = now
        if dist.get_rank() == 0 and (replanned or step % 10 == 0):
            note = ""
            if replanned:
                r = rebalancer.history[-1]
                note = (f"  re-plan: {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f} on "
                        f"the window's mean, {r['step_imbalance_before']:.3f} -> "
                        f"{r['step_imbalance_after']:.3f} per step, {r['moves']} moves, "
                        f"{r['bytes'] / 1e6:.2f} MB")
                if r["moves"] == 0 and r["imbalance_after"] < r["imbalance_before"]:
                    note += (" (no expert moved: the tokens of replicated experts were re-split "
                             "between their replicas)")
            print(f"step {step:4d}  loss {float(total[-1]):.3f}  imbalance {imbalance:.3f}{note}",
                  flush=True)


def plain_loop(rank: int, world: int, steps: int, every: int) -> list:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=every)
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    log = StepLog(model, world)
    for step in range(steps):
        batch = data(step)
        loss, share = train_loss(model(batch[:, :-1]), batch[:, 1:], world, under_ddp=False)
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 1.0)     # by the global norm, so replicas scale alike
        optimizer.step()
        rebalancer.step()
        log.record(step, share, rebalancer)
    rebalancer.finish()
    return log.rows, model


def ddp_loop(rank: int, world: int, steps: int, every: int) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build()
    # The model is the user's own module: keep its expert slots out of DDP (each rank holds other
    # experts in the same rows). DDP averages the dense part, moebalance reduces the replicas.
    ddp = DDP(mb.exclude_experts_from_ddp(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=every)
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    log = StepLog(model, world)
    for step in range(steps):
        batch = data(step)
        loss, share = train_loss(ddp(batch[:, :-1]), batch[:, 1:], world, under_ddp=True)
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 1.0)
        optimizer.step()
        rebalancer.step()
        log.record(step, share, rebalancer)
    rebalancer.finish()
    return log.rows, model


def windows(rank: int, world: int, steps: int) -> list:
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    return [row for step in range(steps) for row in data(step)]


def all_windows(world: int, steps: int, order: str) -> list:
    """Every rank's rows, laid out so that a framework's sharding hands rank r its own rows:
    order "batch" (batch i to rank i % world: accelerate) or "row" (row i to rank i % world:
    torch's DistributedSampler without shuffling)."""
    streams = [TextBatches(SEQ, BATCH, world, r, seed=0) for r in range(world)]
    rows = []
    for step in range(steps):
        batches = [stream(step) for stream in streams]
        if order == "batch":
            rows += [row for batch in batches for row in batch]
        else:
            rows += [batches[r][i] for i in range(BATCH) for r in range(world)]
    return rows


def as_lightning_rank(rank: int) -> None:
    """Spawned ranks (not torchrun's) tell Lightning that its processes already exist, as torchrun
    does: with LOCAL_RANK set, Lightning's DDP joins the process group instead of starting ranks."""
    if not under_torchrun():
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("NODE_RANK", "0")


def lightning_loop(rank: int, world: int, steps: int, every: int) -> list:
    import lightning as L

    from moebalance.integrations.lightning import RebalanceCallback

    class LogSteps(L.Callback):
        # Not `self.log`: Lightning sets `callback.log = pl_module.log` on every callback.
        def __init__(self, step_log):
            self.step_log = step_log

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_log.record(batch_idx, pl_module.share, rebalance.rebalancer)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = build()

        def training_step(self, batch, batch_idx):
            # Inside Lightning's DDP forward: active_ddp finds it (None on one device).
            loss, self.share = train_loss(self.lm(batch[:, :-1]), batch[:, 1:], world,
                                          under_ddp=active_ddp(self) is not None)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)

    as_lightning_rank(rank)
    module = Module()
    rebalance = RebalanceCallback(TOPOLOGY, every=every)
    log = StepLog(module, world)
    # The way Lightning users write it: its DDP strategy (the callback keeps the experts out of
    # DDP) and a DistributedSampler over every rank's rows. Given a plain DataLoader, Lightning
    # installs one that shuffles: a DataLoader with its own unshuffled one keeps the rows in order.
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[rebalance, LogSteps(log)])
    rows = all_windows(world, steps, order="row")
    sampler = torch.utils.data.DistributedSampler(rows, shuffle=False)
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler))
    return log.rows, module.lm


def hf_loop(rank: int, world: int, steps: int, every: int) -> list:
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback

    class HFModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = build()

        def forward(self, input_ids, labels=None):
            logits = self.lm(input_ids[:, :-1])
            # The Trainer's DDP runs this forward under torchrun, none when spawned.
            loss, self.share = train_loss(logits, input_ids[:, 1:], world,
                                          under_ddp=active_ddp(self) is not None)
            return {"loss": loss, "logits": logits}

    class LogSteps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.record(state.global_step - 1, model.share, rebalance.rebalancer)

    # Under torchrun the Trainer wraps this module in DDP: keep its experts out.
    model = mb.exclude_experts_from_ddp(HFModel())
    log = StepLog(model, world)
    rebalance = RebalanceTrainerCallback(TOPOLOGY, every=every)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=3e-3,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
            train_sampling_strategy="sequential", average_tokens_across_devices=False,
            # The other loops' optimizer: AdamW at a constant rate, no weight decay.
            lr_scheduler_type="constant", weight_decay=0.0)
        # Under torchrun the Trainer shards what it is handed (batch i to rank i % world): hand
        # it every rank's rows. Spawned, it does not: hand each rank its own.
        rows = (all_windows(world, steps, order="batch") if args.world_size > 1
                else windows(rank, world, steps))
        data = [{"input_ids": row} for row in rows]
        # The rebalancing callback runs first, so the step log sees its re-plan of the step.
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             callbacks=[rebalance, LogSteps()]).train()
    return log.rows, model.lm


LOOPS = {"plain": plain_loop, "ddp": ddp_loop, "lightning": lightning_loop, "hf": hf_loop}


def worker(rank: int, world: int, loop: str, steps: int, every: int, out: str) -> None:
    require_world_size(world, TOPOLOGY.num_devices)
    # "all": every loop in turn in this one group (Lightning last: it leaves LOCAL_RANK set).
    names = ["plain", "ddp", "hf", "lightning"] if loop == "all" else [loop]
    reference = None
    for name in names:
        rows, model = LOOPS[name](rank, world, steps, every)
        # Every rank holds the experts its placement names (replicas bit-identical), and with
        # several loops the weights match the first loop's: no framework moved or mixed slots.
        state = check_experts(model)
        if reference is None:
            reference = state
        drift = max(float((state[k] - v).abs().max()) for k, v in reference.items())
        if rank == 0:
            losses = [r["loss"] for r in rows]
            print(f"mean training loss over {steps} steps (all ranks): "
                  f"{sum(losses) / len(losses):.9f} ({name} loop)")
            print(bought(rows))
            if len(names) > 1:
                print(f"weights (every expert by id, dense part) against the {names[0]} loop's: "
                      f"max |difference| {drift:.3g} ({name} loop)")
            path = Path(out) if len(names) == 1 else Path(out).with_stem(f"{Path(out).stem}_{name}")
            path.with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
            plot(rows, path, name)


def check_experts(model) -> dict:
    """The model's weights with every expert once, by logical id (collective), after checking
    that the replicas of each expert are bit-identical on every rank that holds one."""
    for layer in moe_layers(model):
        rows = {}
        for slot, expert in enumerate(layer.local_experts.tolist()):
            rows[expert] = torch.cat([p.detach()[slot].flatten() for p in layer.slot_parameters()])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        for held in everyone:      # the same on every rank: all raise alike
            for expert, values in held.items():
                first = next(other[expert] for other in everyone if expert in other)
                if not torch.equal(values, first):
                    raise RuntimeError(f"layer {layer.layer}: replicas of expert {expert} differ")
    return {k: v for k, v in expert_state_dict(model)["model"].items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def plot(rows: list, path: Path, loop: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot(steps, [r["imbalance"] for r in rows], label="per-step imbalance")
    for r in rows:
        if r["replan"]:
            top.axvline(r["step"], color="tab:red", alpha=0.4, lw=1)
    top.set_ylabel("imbalance (1.0 = perfect)")
    top.set_title(f"Live rebalancing on 4 gloo ranks of speed 1, 1, 0.5, 0.5 ({loop} loop); "
                  f"red lines: re-plans", fontsize=9)
    bottom.plot(steps, [r["loss"] for r in rows], color="tab:green")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path} and {path.with_suffix('.json')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--every", type=int, default=15, help="re-plan every N steps (default 15)")
    parser.add_argument("--loop", choices=sorted(LOOPS) + ["all"], default="plain",
                        help="training loop: plain (default), ddp, lightning, hf, or all of them "
                             "in turn (plots and JSON named <out>_<loop>)")
    parser.add_argument("--quick", action="store_true", help="6 steps, re-plan every 3")
    parser.add_argument("--out", default="train_rebalance.png",
                        help="plot path (default ./train_rebalance.png)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every = 6, 3
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)   # before training, not after it
    # The frameworks' imports, once before the ranks fork instead of once per rank.
    frameworks = {"lightning": ["lightning"], "hf": ["transformers.trainer"]}
    preload = [m for loop, mods in frameworks.items() if args.loop in (loop, "all") for m in mods]
    launch(worker, TOPOLOGY.num_devices, args=(args.loop, args.steps, args.every, args.out),
           preload=tuple(preload))


if __name__ == "__main__":
    main()
