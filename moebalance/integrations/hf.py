"""Hugging Face ``Trainer``: ``RebalanceTrainerCallback`` re-plans and migrates the experts while it trains.

::

    from moebalance.integrations.hf import RebalanceTrainerCallback
    trainer = transformers.Trainer(model, args, callbacks=[RebalanceTrainerCallback(topology, every=200)])

Seams: ``on_train_begin`` builds the :class:`~moebalance.Rebalancer` over the model and the
Trainer's optimizer (under accelerate's wrapper); ``on_step_end`` (after ``optimizer.step()``
and ``zero_grad``, once per optimizer step, not per micro-batch) calls ``Rebalancer.step()``;
``on_train_end`` finishes a migration in flight. The Trainer has no callback between backward
and gradient clipping, which is why replica gradients are reduced by autograd hooks during
backward. The Trainer's clipping is per rank, which would scale replicas of one expert by
different factors: the callback sets ``args.max_grad_norm`` to 0 and clips by the global norm
(:func:`moebalance.clip_grad_norm_`) in ``on_pre_optimizer_step`` instead.

State that must survive a restart: the placement lives in the model's ``state_dict`` (each
ExpertParallelMoE layer's extra state), since Trainer callback state is JSON and not restored
by default; the Rebalancer's step counter resumes from ``state.global_step``. The Trainer
writes the model from one process: an expert-parallel model's other ranks' slots are not in
that file; save the experts by logical id with :func:`moebalance.checkpoint.save`.

Importing this module imports transformers.
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("moebalance.integrations.hf needs transformers: "
                      "pip install 'moebalance[transformers]'") from exc

from ..nn import clip_grad_norm_
from ..topology import Topology
from .loop import Rebalancer, torch_optimizer

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

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.rebalancer is None:
            if model is None:
                raise ValueError("RebalanceTrainerCallback needs the Trainer's model; use it inside "
                                 "transformers.Trainer(callbacks=[...])")
            model = getattr(model, "module", model)       # under a DDP wrapper
            self._model = model
            # The Trainer clips each rank by its own norm, which splits replicas: take the
            # clipping over and clip by the global norm in on_pre_optimizer_step.
            if args.max_grad_norm:
                self.max_grad_norm, args.max_grad_norm = float(args.max_grad_norm), 0.0
            self.rebalancer = Rebalancer(model, self.topology, torch_optimizer(optimizer),
                                         self.every, **self.options)
            self.rebalancer.resume(int(state.global_step))
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm and self._model is not None:
            clip_grad_norm_(self._model, self.max_grad_norm)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.rebalancer is not None:
            self.rebalancer.step()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.rebalancer is not None:
            self.rebalancer.finish()
        return control
