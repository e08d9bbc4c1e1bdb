"""Hugging Face Trainer: ``RebalanceTrainerCallback`` re-plans and migrates experts as it trains.

::

    from moebalance.integrations.hf import RebalanceTrainerCallback
    trainer = transformers.Trainer(model, args,
                                   callbacks=[RebalanceTrainerCallback(topology, every=200)])

Seams: ``on_train_begin`` builds the :class:`~moebalance.Rebalancer` over the model and the
Trainer's optimizer (under accelerate's wrapper); ``on_step_end`` (after ``optimizer.step()``
and ``zero_grad``, once per optimizer step, not per micro-batch) calls ``Rebalancer.step()``;
``on_train_end`` finishes a migration in flight. The Trainer has no callback between backward
and gradient clipping, which is why replica gradients are reduced by autograd hooks during
backward. The Trainer's clipping is per rank, which would scale replicas of one expert by
different factors: the callback sets ``args.max_grad_norm`` to infinity (the Trainer's clip
still unscales fp16 gradients and clips nothing) and clips by the global norm
(:func:`moebalance.clip_grad_norm_`) in ``on_pre_optimizer_step`` instead.

Under torchrun the Trainer wraps the model in DDP (accelerate) and shards the dataset it is
handed (hand it the whole dataset); the wrapped model lists its expert slots in DDP's ignore
list, so DDP averages the dense part and leaves each rank's experts alone (see
:mod:`moebalance.frameworks`). Spawned without torchrun's environment the Trainer does neither:
hand each rank its own rows.

Saving: the Trainer writes the model and the optimizer state from rank 0 alone, which hold only
rank 0's experts. While it trains, the wrapped model's own ``save_pretrained`` writes nothing and
``on_save`` (every rank, collective) writes, into the checkpoint folder, ``moebalance_state.pt``
(every expert and its optimizer state by logical id, and the Rebalancer's counters and window)
and, for a transformers model, the whole model with :func:`moebalance.save_pretrained`; outside
training ``save_pretrained`` raises, naming that function. Resuming
(``trainer.train(resume_from_checkpoint=...)``) works: after the Trainer's own load, which puts
rank 0's experts and optimizer state on every rank, ``on_train_begin`` loads
``moebalance_state.pt`` into the placement each rank holds now (any placement) and the
Rebalancer carries on from the saved step. A checkpoint without that file is refused on every
rank before training starts. With ``load_best_model_at_end`` the Trainer loads the best
checkpoint's dense weights only; ``on_train_end`` loads its experts from the same file.

Metrics: each re-plan's figures (``moebalance/imbalance_before``, ``.../after``, per step
``.../step_imbalance_before`` and ``.../step_imbalance_after``, ``moves``, ``bytes``,
``plan_ms``, ``migration_s``) join the next ``logs`` the Trainer reports, through ``on_log``;
the callback runs right after the Trainer's flow callback, so reporting integrations
(TensorBoard, W&B) see them.

Importing this module imports transformers.
"""

from __future__ import annotations

import math

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("moebalance.integrations.hf needs transformers: "
                      "pip install 'moebalance[transformers]'") from exc

import os
import sys

import torch
import torch.distributed as dist

from ..collective_errors import flag_device
from ..nn import checkpoint
from ..nn.moe import clip_grad_norm_
from ..topology import Topology
from .loop import Rebalancer, logged_figures, torch_optimizer

__all__ = ["RebalanceTrainerCallback"]

# Written by on_save into each checkpoint folder, read back when the Trainer resumes from it.
STATE_FILE = "moebalance_state.pt"


class RebalanceTrainerCallback(TrainerCallback):
    """transformers ``TrainerCallback`` around :class:`~moebalance.Rebalancer`.

    Args:
        topology: the devices, one per rank of the expert-parallel group.
        every, threshold, max_moves, ...: passed to :class:`~moebalance.Rebalancer`.
    """

    def __init__(self, topology: Topology, every: int | None = 200, **rebalancer_options) -> None:
        self.topology = topology
        self.every = every
        self.options = rebalancer_options
        self.rebalancer: Rebalancer | None = None
        self.max_grad_norm = 0.0
        self._model = None
        self._pending_logs: dict = {}
        self._logged = 0

    def _run_before_reporters(self) -> None:
        """Move this callback right after the Trainer's flow callback in the handler that calls
        it, so the figures it adds in ``on_log`` reach the reporting callbacks."""
        handler = sys._getframe(2).f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and self in callbacks:
            callbacks.remove(self)
            flow = [i for i, c in enumerate(callbacks) if type(c).__name__ == "DefaultFlowCallback"]
            callbacks.insert(flow[0] + 1 if flow else 0, self)

    @staticmethod
    def _refuse_sharding(args) -> None:
        """FSDP and DeepSpeed shard every parameter as one tensor over the ranks: the expert
        slots, which hold other experts on every rank, would be mixed."""
        sharding = [name for name in ("fsdp", "deepspeed") if getattr(args, name, None)]
        if sharding:
            raise ValueError(
                f"RebalanceTrainerCallback: TrainingArguments({sharding[0]}=...) shards the "
                "model's parameters over the ranks, and the expert slots hold other experts on "
                "every rank. Train without fsdp/deepspeed: the Trainer's DistributedDataParallel "
                "under torchrun works")

    def on_init_end(self, args, state, control, **kwargs):
        self._refuse_sharding(args)
        return control

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._refuse_sharding(args)
        # A resumed Trainer has loaded rank 0's experts and optimizer state on every rank.
        saved = (self._saved_state(_resumed_folder(args, state), "resuming transformers.Trainer "
                                   f"at step {state.global_step}")
                 if state.global_step > 0 else None)
        self._run_before_reporters()
        if model is None:
            raise ValueError("RebalanceTrainerCallback needs the Trainer's model; use it "
                             "inside transformers.Trainer(callbacks=[...])")
        model = getattr(model, "module", model)       # under a DDP wrapper
        optimizer = torch_optimizer(optimizer)
        if self.rebalancer is None or model is not self._model or saved is not None:
            self._model = model
            # The Trainer clips each rank by its own norm, which splits replicas: take the
            # clipping over and clip by the global norm in on_pre_optimizer_step. Its own clip
            # stays on at an infinite norm (it clips nothing): that call is what unscales fp16
            # gradients before on_pre_optimizer_step in Trainers that clip only when
            # max_grad_norm > 0.
            if args.max_grad_norm and math.isfinite(args.max_grad_norm):
                self.max_grad_norm, args.max_grad_norm = float(args.max_grad_norm), math.inf
            if saved is not None:
                checkpoint.load_expert_state_dict(model, saved["experts"], optimizer)
            self.rebalancer = Rebalancer(model, self.topology, optimizer, self.every,
                                         **self.options)
            self._logged = 0
            if saved is not None and saved.get("rebalancer"):
                self.rebalancer.load_state_dict(saved["rebalancer"])
                self._logged = len(self.rebalancer.history)
            else:
                self.rebalancer.resume(int(state.global_step))
        guard = getattr(self._model, "save_pretrained", None)
        if hasattr(guard, "redirected"):
            guard.redirected = True            # on_save writes every expert instead
        return control

    @staticmethod
    def _saved_state(folder: str, doing: str) -> dict:
        """What on_save wrote into ``folder``; every rank raises the same error, saying what it
        was ``doing``, when a rank lacks it."""
        path = os.path.join(folder, STATE_FILE)
        found = os.path.isfile(path)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(found)], device=flag_device(None))   # NCCL: on the GPU
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            found = bool(flag.item())
        if not found:
            raise ValueError(
                f"{doing} needs {STATE_FILE} (every expert and its optimizer state, written by "
                f"RebalanceTrainerCallback's on_save) in {folder}, on every rank: use a "
                f"checkpoint saved with the callback, or load the model with "
                f"mb.from_pretrained(folder, topology) and start a new Trainer "
                f"(resume_from_checkpoint=None)")
        return torch.load(path, map_location="cpu", weights_only=True)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm and self._model is not None:
            clip_grad_norm_(self._model, self.max_grad_norm)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.rebalancer is not None:
            self.rebalancer.step()
            for report in self.rebalancer.history[self._logged:]:
                self._pending_logs.update(logged_figures(report))
            self._logged = len(self.rebalancer.history)
            last = self.rebalancer.history[-1] if self.rebalancer.history else None
            if last is not None and last.get("migration_s") is not None:
                self._pending_logs.setdefault("moebalance/migration_s", float(last["migration_s"]))
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending_logs:
            logs.update(self._pending_logs)
            self._pending_logs = {}
        return control

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        if self._model is not None:
            if self.rebalancer is not None:
                self.rebalancer.finish()
            from .wrap import write_pretrained

            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            optimizer = torch_optimizer(optimizer) if optimizer is not None else (
                self.rebalancer.optimizer if self.rebalancer is not None else None)
            experts = checkpoint.expert_state_dict(self._model, optimizer)   # every rank
            if args.should_save:
                os.makedirs(folder, exist_ok=True)
                saved = {"experts": experts, "step": int(state.global_step),
                         "rebalancer": (self.rebalancer.state_dict()
                                        if self.rebalancer is not None else None)}
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                tmp = os.path.join(folder, f"{STATE_FILE}.tmp{rank}")
                torch.save(saved, tmp)
                os.replace(tmp, os.path.join(folder, STATE_FILE))   # never half a file
            if getattr(self._model, "config", None) is not None:      # a transformers model
                write_pretrained(self._model, folder, experts["model"])   # rank 0 writes
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.rebalancer is not None:
            self.rebalancer.finish()
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best is not None and self._model is not None:
            # The Trainer loaded the best checkpoint's dense weights but not the experts (they
            # are saved by logical id): load them, or the model mixes two steps.
            saved = self._saved_state(best, "load_best_model_at_end")
            checkpoint.load_expert_state_dict(self._model, saved["experts"])
        guard = getattr(self._model, "save_pretrained", None)
        if hasattr(guard, "redirected"):
            guard.redirected = False
        return control


def _resumed_folder(args, state) -> str:
    """The checkpoint folder the Trainer resumed from: its ``resume_from_checkpoint`` (a local
    of the Trainer's training loop, which does not pass it to callbacks), else
    ``output_dir/checkpoint-<step>``, where the Trainer saves."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            break
        value = frame.f_locals.get("resume_from_checkpoint")
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
