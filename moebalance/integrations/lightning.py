"""Lightning 2.x: ``RebalanceCallback`` re-plans and migrates the experts during ``Trainer.fit``.

::

    from moebalance.integrations.lightning import RebalanceCallback
    trainer = lightning.Trainer(callbacks=[RebalanceCallback(topology, every=200)])

Seams: ``on_train_start`` builds the :class:`~moebalance.Rebalancer` over the LightningModule and
the trainer's first optimizer; ``on_before_optimizer_step`` marks a batch that steps (with
gradient accumulation only the last micro-batch does), and ``on_train_batch_end``, after that
step, calls ``Rebalancer.step()``. ``on_save_checkpoint`` finishes a migration in flight and
stores the experts and their optimizer state by logical id (``checkpoint["moebalance"]``):
``on_load_checkpoint`` loads the experts into whatever placement the model has, and
``on_train_start``, after Lightning restored the optimizer (under DDP, rank 0's state on every
rank), puts every expert's optimizer state back, so ``fit(ckpt_path=...)`` resumes exactly.
Replica gradients are final before Lightning clips them (they are reduced during backward).

Strategies: ``strategy="ddp"`` (``devices=N``, launched by Lightning or by torchrun) and a
single device. At ``setup`` the callback lists the expert slots in the LightningModule's DDP
ignore list (:func:`moebalance.exclude_experts_from_ddp`), so Lightning's DDP averages the dense
parameters and leaves each rank's experts alone; ``mb.wrap`` the model in ``configure_model``
(the process group exists by then) or before ``fit``. Sharding strategies (FSDP, DeepSpeed,
model parallel) are refused at ``setup`` / ``on_fit_start``: they would shard or gather the
slots. Re-plan figures go to ``pl_module.log`` (``moebalance/imbalance_before``, ``.../after``,
per step ``.../step_imbalance_before`` and ``.../step_imbalance_after``, ``moves``, ``bytes``,
``plan_ms``, ``migration_s``), so every Lightning logger sees them.

Importing this module imports Lightning (``lightning`` or ``pytorch_lightning``).
"""

from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError:  # the standalone package name
    try:
        from pytorch_lightning.callbacks import Callback
        from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
    except ImportError as exc:
        raise ImportError("moebalance.integrations.lightning needs Lightning 2.x: "
                          "pip install 'moebalance[lightning]' (or lightning>=2.2)") from exc

from ..frameworks import exclude_experts_from_ddp
from ..nn import checkpoint
from ..nn.moe import clip_grad_norm_, moe_layers
from ..nn.slots import _OTHER_RANKS_ROWS
from ..topology import Topology
from .loop import Rebalancer, logged_figures, torch_optimizer

__all__ = ["RebalanceCallback"]


class RebalanceCallback(Callback):
    """Lightning callback around :class:`~moebalance.Rebalancer`.

    Args:
        topology: the devices, one per rank of the expert-parallel group.
        every, threshold, max_moves, ...: passed to :class:`~moebalance.Rebalancer`.
        save_experts: store the experts by logical id in Lightning checkpoints (a collective on
            every rank while saving).
    """

    def __init__(self, topology: Topology, every: int | None = 200, *, save_experts: bool = True,
                 **rebalancer_options) -> None:
        super().__init__()
        self.topology = topology
        self.every = every
        self.save_experts = bool(save_experts)
        self.options = rebalancer_options
        self.rebalancer: Rebalancer | None = None
        self._stepped = False
        self._restored: dict | None = None
        self._saved_experts: dict | None = None     # from a checkpoint, until the optimizer exists

    def _check_strategy(self, trainer) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
            raise ValueError(
                f"RebalanceCallback runs under strategy='ddp' (DDPStrategy, devices=N) or on one "
                f"device, not {type(strategy).__name__}: it would shard or gather the expert "
                f"slots, which differ per rank")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._check_strategy(trainer)
        # Names read when Lightning builds its DDP, after configure_model may have wrapped.
        exclude_experts_from_ddp(pl_module)
        if not getattr(pl_module, "_moebalance_resume_hooks", False):
            # Under DDP Lightning loads rank 0's state_dict on every rank; on_load_checkpoint
            # then loads every expert by logical id, so other ranks' slot rows may pass here.
            pl_module.register_load_state_dict_pre_hook(_allow_other_ranks_rows)
            pl_module.register_load_state_dict_post_hook(_end_other_ranks_rows)
            pl_module._moebalance_resume_hooks = True

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_strategy(trainer)

    def _log_replan(self, pl_module, report: dict) -> None:
        pl_module.log_dict(logged_figures(report), on_step=True, on_epoch=False, batch_size=1)

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = torch_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        if self._saved_experts is not None:
            # Lightning restored the optimizer from the checkpoint after on_load_checkpoint:
            # under DDP that is rank 0's state on every rank, so every expert's state is put
            # back by logical id now.
            checkpoint.load_expert_state_dict(pl_module, self._saved_experts, optimizer)
            self._saved_experts = None
        if self.rebalancer is None:
            self.rebalancer = Rebalancer(pl_module, self.topology, optimizer, self.every,
                                         **self.options)
            if self._restored is not None:
                self.rebalancer.load_state_dict(self._restored)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True
        # Lightning clips each rank by its own norm, which splits replicas; clip by the global
        # norm first, after which Lightning's clipping to the same value changes nothing.
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").lower()
        if trainer.gradient_clip_val and algorithm.endswith("norm"):
            clip_grad_norm_(pl_module, float(trainer.gradient_clip_val))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._stepped and self.rebalancer is not None:
            self._stepped = False
            migrating = self.rebalancer._report if self.rebalancer.migrating else None
            report = self.rebalancer.step()
            if report is not None:
                self._log_replan(pl_module, report)
            if migrating is not None and migrating.get("migration_s") is not None:
                pl_module.log("moebalance/migration_s", float(migrating["migration_s"]),
                              on_step=True, on_epoch=False, batch_size=1)

    def _finish(self, *_) -> None:
        if self.rebalancer is not None:
            self.rebalancer.finish()

    # A migration in flight writes the rows it staged when the layer next runs a forward.
    # Lightning's WeightAveraging swaps the model's values with its average's for each
    # validation and copies the average in when training ends: a commit after either would
    # put the staged rows over them. So a migration commits before validation and at the
    # epoch's end (before any callback's on_train_end), and the average's copy follows it.
    on_validation_start = _finish
    on_train_epoch_end = _finish
    on_train_end = _finish

    def on_save_checkpoint(self, trainer, pl_module, ckpt: dict) -> None:
        self._finish()
        if self.save_experts:
            optimizer = torch_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
            ckpt["moebalance"] = checkpoint.expert_state_dict(pl_module, optimizer)

    def on_load_checkpoint(self, trainer, pl_module, ckpt: dict) -> None:
        _OTHER_RANKS_ROWS[0] = 0
        foreign = [layer for layer in moe_layers(pl_module)
                   if getattr(layer, "other_ranks_rows_loaded", False)]
        for layer in foreign:
            layer.other_ranks_rows_loaded = False
        if foreign and "moebalance" not in ckpt:
            raise ValueError("this checkpoint holds rank 0's expert slots only (saved with "
                             "RebalanceCallback(save_experts=False) or without the callback); "
                             "resume from one saved with save_experts=True, which stores every "
                             "expert by logical id")
        if "moebalance" in ckpt:
            # The weights now (validate/test/predict from ckpt_path need no more); the
            # optimizer state, which Lightning restores later, at on_train_start.
            checkpoint.load_expert_state_dict(pl_module, ckpt["moebalance"])
            if ckpt["moebalance"].get("optimizer") is not None:
                self._saved_experts = ckpt["moebalance"]

    def state_dict(self) -> dict:
        return {} if self.rebalancer is None else self.rebalancer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self._restored = state_dict
            if self.rebalancer is not None:
                self.rebalancer.load_state_dict(state_dict)


def _allow_other_ranks_rows(module, *args) -> None:
    _OTHER_RANKS_ROWS[0] += 1


def _end_other_ranks_rows(module, incompatible_keys) -> None:
    _OTHER_RANKS_ROWS[0] = max(0, _OTHER_RANKS_ROWS[0] - 1)
