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
different factors: the callback sets ``args.max_grad_norm`` to 0 and clips by the global norm
(:func:`moebalance.clip_grad_norm_`) in ``on_pre_optimizer_step`` instead.

Under torchrun the Trainer wraps the model in DDP (accelerate) and shards the dataset it is
handed (hand it the whole dataset); the wrapped model lists its expert slots in DDP's ignore
list, so DDP averages the dense part and leaves each rank's experts alone (see
:mod:`moebalance.frameworks`). Spawned without torchrun's environment the Trainer does neither:
hand each rank its own rows.

Saving: the Trainer writes the model from rank 0 alone, which would hold only rank 0's experts.
While it trains, the wrapped model's own ``save_pretrained`` writes nothing and ``on_save``
(every rank) writes the whole model into the checkpoint folder with
:func:`moebalance.save_pretrained` (collective); outside training it raises, naming that
function. Resuming the Trainer from such a checkpoint (``resume_from_checkpoint``) is refused
at ``on_train_begin`` on every rank: the Trainer's own load does not read experts by logical id
and restores rank 0's optimizer state alone; load the folder with :func:`moebalance.from_pretrained`
and start a new Trainer instead.

Metrics: each re-plan's figures (``moebalance/imbalance_before``, ``.../after``, per step
``.../step_imbalance_before`` and ``.../step_imbalance_after``, ``moves``, ``bytes``,
``plan_ms``, ``migration_s``) join the next ``logs`` the Trainer reports, through ``on_log``;
the callback runs right after the Trainer's flow callback, so reporting integrations
(TensorBoard, W&B) see them.

Importing this module imports transformers.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("moebalance.integrations.hf needs transformers: "
                      "pip install 'moebalance[transformers]'") from exc

import os
import sys

from ..nn.moe import clip_grad_norm_
from ..topology import Topology
from .loop import Rebalancer, logged_figures, torch_optimizer

__all__ = ["RebalanceTrainerCallback"]


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

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.rebalancer is None and state.global_step > 0:
            # The Trainer restored its state from a checkpoint and loaded it into the model
            # itself: that load does not read experts saved by logical id, and the optimizer
            # state it restores is rank 0's alone. Every rank sees the same step: all refuse.
            raise ValueError(
                f"resuming transformers.Trainer from a checkpoint (step {state.global_step}) is "
                "not supported for an expert-parallel model: its experts and their optimizer "
                "state are per rank; load the checkpoint's model with mb.from_pretrained(folder, "
                f"topology) and train it with a new Trainer (resume_from_checkpoint=None)")
        self._run_before_reporters()
        if self.rebalancer is None:
            if model is None:
                raise ValueError("RebalanceTrainerCallback needs the Trainer's model; use it "
                                 "inside transformers.Trainer(callbacks=[...])")
            model = getattr(model, "module", model)       # under a DDP wrapper
            self._model = model
            # The Trainer clips each rank by its own norm, which splits replicas: take the
            # clipping over and clip by the global norm in on_pre_optimizer_step.
            if args.max_grad_norm:
                self.max_grad_norm, args.max_grad_norm = float(args.max_grad_norm), 0.0
            self.rebalancer = Rebalancer(model, self.topology, torch_optimizer(optimizer),
                                         self.every, **self.options)
            self.rebalancer.resume(int(state.global_step))
        guard = getattr(self._model, "save_pretrained", None)
        if hasattr(guard, "redirected"):
            guard.redirected = True            # on_save writes every expert instead
        return control

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

    def on_save(self, args, state, control, **kwargs):
        if self._model is not None:
            if self.rebalancer is not None:
                self.rebalancer.finish()
            from .wrap import save_pretrained

            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            save_pretrained(self._model, folder)           # every rank: every expert
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.rebalancer is not None:
            self.rebalancer.finish()
        guard = getattr(self._model, "save_pretrained", None)
        if hasattr(guard, "redirected"):
            guard.redirected = False
        return control
