"""The three training-loop styles each drive a real live migration on 4 gloo ranks.

Plain loop (:class:`moebalance.Rebalancer`), Lightning (``RebalanceCallback``) and the Hugging Face
Trainer (``RebalanceTrainerCallback``) train the small moebalance language model on real text
(the standard library's source) with devices of unlike speed; each must re-plan, move experts
(weights and optimizer state) beside the step and keep the replicas identical.
"""

from __future__ import annotations

import importlib.util
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import case_id, shared_spawn
from test_live_rebalance_distributed import assert_replicas_identical

import moebalance as mb
from moebalance.lab.models import MoELanguageModel, TextBatches, lm_loss

WORLD = 4
TOPOLOGY = mb.Topology.from_arrays(speed=[1.0, 1.0, 0.5, 0.5], slots=[3, 3, 3, 3],
                                   node=[0, 0, 1, 1])
SEQ, BATCH, STEPS, EVERY = 32, 4, 8, 3


def small_model():
    return MoELanguageModel(mb.plan(np.ones((2, 8)), TOPOLOGY), hidden=32, ffn=48, experts=8,
                            top_k=2, layers=2, heads=2, seed=3)


def check_migrated(rebalancer, model):
    moved = [r for r in rebalancer.history if r["moves"] > 0]
    assert moved, rebalancer.history
    assert all(r["error"] is None and r["migration_s"] is not None for r in moved), moved
    # Committed inside training, before the next optimizer step (not resent, not at the end).
    assert all(r["resends"] == 0 for r in moved), moved
    assert_replicas_identical(model)


def plain_loop_drives_a_migration():
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=EVERY)
    data = TextBatches(SEQ, BATCH, WORLD, dist.get_rank(), seed=1)
    for step in range(STEPS):
        batch = data(step)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:], WORLD * BATCH * SEQ)
        optimizer.zero_grad()
        loss.backward()
        mb.clip_grad_norm_(model, 1.0)      # the global norm: replicas scale alike
        optimizer.step()
        rebalancer.step()
    rebalancer.finish()
    check_migrated(rebalancer, model)


def _windows(rank: int) -> list:
    data = TextBatches(SEQ, BATCH, WORLD, rank, seed=2)
    return [row for step in range(STEPS) for row in data(step)]


def lightning_callback_drives_a_migration():
    import lightning as L

    from moebalance.integrations.lightning import RebalanceCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = small_model()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.lm(batch[:, :-1]), batch[:, 1:], WORLD * BATCH * SEQ)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    module = Module()
    callback = RebalanceCallback(TOPOLOGY, every=EVERY)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[callback])
    loader = torch.utils.data.DataLoader(_windows(dist.get_rank()), batch_size=BATCH)
    trainer.fit(module, loader)
    check_migrated(callback.rebalancer, module)


def hf_trainer_callback_drives_a_migration():
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback

    class HFModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = small_model()

        def forward(self, input_ids, labels=None):
            logits = self.lm(input_ids[:, :-1])
            return {"loss": lm_loss(logits, input_ids[:, 1:], WORLD * BATCH * SEQ),
                    "logits": logits}

    model = HFModel()
    callback = RebalanceTrainerCallback(TOPOLOGY, every=EVERY)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0)
        data = [{"input_ids": row} for row in _windows(dist.get_rank())]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[callback])
        # the Trainer itself does not wrap the experts in DDP
        assert trainer.args.world_size == 1
        trainer.train()
    check_migrated(callback.rebalancer, model)


def plain_loop_replans_when_moves_pay():
    """No period, no threshold: a move price low enough that moves pay re-plans at a check."""
    from moebalance.planner import MoveCost

    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=None, check_every=EVERY,
                               move_cost=MoveCost(1.0, 1e9, 100, 1.0))
    data = TextBatches(SEQ, BATCH, WORLD, dist.get_rank(), seed=1)
    for step in range(STEPS):
        batch = data(step)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:], WORLD * BATCH * SEQ)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rebalancer.step()
    rebalancer.finish()
    check_migrated(rebalancer, model)


CASES = [plain_loop_drives_a_migration, plain_loop_replans_when_moves_pay]
if importlib.util.find_spec("lightning") is not None:
    CASES.append(lightning_callback_drives_a_migration)
if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("accelerate"):
    CASES.append(hf_trainer_callback_drives_a_migration)


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=500.0,
                            collective_timeout_s=60.0)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_loop(dist_results, case):
    dist_results.check(case)


def test_hf_callback_refuses_a_trainer_resume_at_once():
    """A Trainer resumed from a checkpoint has already loaded the model its own way (not by
    logical expert) and rank 0's optimizer state: the callback refuses before training starts."""
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from moebalance.integrations.hf import RebalanceTrainerCallback

    callback = RebalanceTrainerCallback(mb.Topology.uniform(num_devices=1, slots_per_device=4))
    with pytest.raises(ValueError, match=r"mb\.from_pretrained"):
        callback.on_train_begin(SimpleNamespace(max_grad_norm=1.0), SimpleNamespace(global_step=5),
                                SimpleNamespace(), model=None)
