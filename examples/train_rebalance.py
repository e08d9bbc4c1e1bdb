"""Train a small MoE language model on 4 gloo ranks of unlike speed, rebalancing it live.

The model (moebalance.models.MoELanguageModel: 2 attention + MoE blocks, 8 experts, top-2) reads
bytes of the Python standard library's source. The devices have speeds 1, 1, 0.5, 0.5 and 3
expert slots each. Every --every steps a Rebalancer re-plans from the tracked loads (moving few
experts) and migrates weights and AdamW state beside the next step. Printed: loss and the
imbalance of each step's own loads under the placement in force; written: a plot of both.

    python examples/train_rebalance.py [--steps 60] [--every 15] [--loop plain|lightning|hf]
    torchrun --standalone --nproc-per-node 4 examples/train_rebalance.py

--loop lightning needs Lightning 2.x, --loop hf needs transformers and accelerate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moebalance as mb
from moebalance.launch import launch
from moebalance.models import MoELanguageModel, TextBatches, lm_loss

TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3], node=[0, 0, 1, 1])
EXPERTS, LAYERS, SEQ, BATCH = 8, 2, 64, 8


def build():
    placement = mb.plan(np.ones((LAYERS, EXPERTS)), TOPOLOGY)   # first guess: uniform loads
    return MoELanguageModel(placement, hidden=64, ffn=128, experts=EXPERTS, top_k=2,
                            layers=LAYERS, heads=4, seed=0, moe_options={"nodes": TOPOLOGY.node})


class StepLog:
    """Each step's loss and the imbalance of that step's loads under the placement in force."""

    def __init__(self, model, world: int) -> None:
        self.model, self.world, self.rows = model, world, []

    def record(self, step: int, loss: torch.Tensor, rebalancer) -> None:
        counts = rebalancer.last_counts.to(torch.float64)
        total = torch.cat([counts.flatten(), loss.detach().double().view(1)])
        dist.all_reduce(total)
        loads = total[:-1].view_as(counts).numpy()
        placement = mb.current_placement(self.model)
        imbalance = mb.summary_imbalance(loads, placement, TOPOLOGY)
        replanned = bool(rebalancer.history) and rebalancer.history[-1]["step"] == rebalancer.steps
        self.rows.append({"step": step, "loss": float(total[-1]), "imbalance": float(imbalance),
                          "replan": replanned})
        if dist.get_rank() == 0 and (replanned or step % 10 == 0):
            note = ""
            if replanned:
                r = rebalancer.history[-1]
                note = (f"  re-plan: {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f} on the "
                        f"window, {r['moves']} moves, {r['bytes'] / 1e6:.2f} MB")
            print(f"step {step:4d}  loss {float(total[-1]):.3f}  imbalance {imbalance:.3f}{note}",
                  flush=True)


def plain_loop(rank: int, world: int, steps: int, every: int) -> list:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=every)
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    log = StepLog(model, world)
    for step in range(steps):
        batch = data(step)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:], world * BATCH * SEQ)
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 1.0)     # by the global norm, so replicas scale alike
        optimizer.step()
        rebalancer.step()
        log.record(step, loss, rebalancer)
    rebalancer.finish()
    return log.rows


def windows(rank: int, world: int, steps: int) -> list:
    data = TextBatches(SEQ, BATCH, world, rank, seed=0)
    return [row for step in range(steps) for row in data(step)]


def lightning_loop(rank: int, world: int, steps: int, every: int) -> list:
    import lightning as L

    from moebalance.integrations.lightning import RebalanceCallback

    class LogSteps(L.Callback):
        # Not `self.log`: Lightning sets `callback.log = pl_module.log` on every callback.
        def __init__(self, step_log):
            self.step_log = step_log

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_log.record(batch_idx, outputs["loss"], rebalance.rebalancer)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = build()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.lm(batch[:, :-1]), batch[:, 1:], world * BATCH * SEQ)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    module = Module()
    rebalance = RebalanceCallback(TOPOLOGY, every=every)
    log = StepLog(module, world)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[rebalance, LogSteps(log)])
    trainer.fit(module, torch.utils.data.DataLoader(windows(rank, world, steps), batch_size=BATCH))
    return log.rows


def hf_loop(rank: int, world: int, steps: int, every: int) -> list:
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback

    class HFModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = build()

        def forward(self, input_ids, labels=None):
            logits = self.lm(input_ids[:, :-1])
            self.last_loss = lm_loss(logits, input_ids[:, 1:], world * BATCH * SEQ)
            return {"loss": self.last_loss, "logits": logits}

    class LogSteps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.record(state.global_step - 1, model.last_loss, rebalance.rebalancer)

    model = HFModel()
    log = StepLog(model, world)
    rebalance = RebalanceTrainerCallback(TOPOLOGY, every=every)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=3e-3,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0)
        data = [{"input_ids": row} for row in windows(rank, world, steps)]
        # The rebalancing callback runs first, so the step log sees its re-plan of the step.
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             callbacks=[rebalance, LogSteps()]).train()
    return log.rows


LOOPS = {"plain": plain_loop, "lightning": lightning_loop, "hf": hf_loop}


def worker(rank: int, world: int, loop: str, steps: int, every: int, out: str) -> None:
    if world != TOPOLOGY.num_devices:
        raise SystemExit(f"this example describes {TOPOLOGY.num_devices} devices; run it on "
                         f"{TOPOLOGY.num_devices} ranks (got {world})")
    rows = LOOPS[loop](rank, world, steps, every)
    if rank == 0:
        Path(out).with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
        plot(rows, Path(out), loop)


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
    parser.add_argument("--loop", choices=sorted(LOOPS), default="plain",
                        help="training loop: plain (default), lightning or hf")
    parser.add_argument("--out", default="train_rebalance.png", help="plot path (default ./train_rebalance.png)")
    args = parser.parse_args()
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    launch(worker, TOPOLOGY.num_devices, args=(args.loop, args.steps, args.every, args.out))


if __name__ == "__main__":
    main()
