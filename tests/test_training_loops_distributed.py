"""The three training-loop styles each drive a real live migration on 4 gloo ranks.

Plain loop (:class:`moebalance.Rebalancer`), Lightning (``RebalanceCallback``) and the Hugging Face
Trainer (``RebalanceTrainerCallback``) train the small moebalance language model on real text
(the standard library's source) with devices of unlike speed; each must re-plan, move experts
(weights and optimizer state) beside the step and keep the replicas identical.
"""

from __future__ import annotations

import importlib.util
import shutil
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


def lightning_weight_averaging_follows_the_migrations():
    """Lightning's EMA (``WeightAveraging``: an AveragedModel swapped in for each validation and
    copied into the model when training ends), listed before the callback, with validation
    right after each re-plan and training ending on one: the model ends as the same run's
    without re-plans (fp64)."""
    import lightning as L
    from lightning.pytorch.callbacks import WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    from moebalance.integrations.lightning import RebalanceCallback
    from moebalance.nn.checkpoint import expert_state_dict

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = small_model().double()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.lm(batch[:, :-1]), batch[:, 1:], WORLD * BATCH * SEQ)

        def validation_step(self, batch, batch_idx):
            self.lm(batch[:, :-1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def fit(every):
        module = Module()
        callback = RebalanceCallback(TOPOLOGY, every=every) if every else None
        averaging = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=False)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2 * EVERY, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, val_check_interval=EVERY,
                            limit_val_batches=1, num_sanity_val_steps=0,
                            callbacks=[averaging] + [callback] * bool(every))
        loader = torch.utils.data.DataLoader(_windows(dist.get_rank()), batch_size=BATCH)
        trainer.fit(module, loader, loader)
        return callback, module

    callback, module = fit(EVERY)
    check_migrated(callback.rebalancer, module)
    got = expert_state_dict(module.lm)["model"]
    _, fixed = fit(None)
    for key, value in expert_state_dict(fixed.lm)["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{key}: {m}")


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
            report_to=[], save_strategy="steps", save_steps=EVERY + 1, logging_strategy="no",
            use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0)
        data = [{"input_ids": row} for row in _windows(dist.get_rank())]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[callback])
        # the Trainer itself does not wrap the experts in DDP
        assert trainer.args.world_size == 1
        trainer.train()
        # A model without a transformers config: the checkpoint holds the experts' own file.
        saved = torch.load(f"{out}/checkpoint-{EVERY + 1}/moebalance_state.pt", weights_only=True)
        assert saved["step"] == EVERY + 1 and saved["rebalancer"]["steps"] == EVERY + 1
    check_migrated(callback.rebalancer, model)


def hf_trainer_resumes_from_its_own_checkpoint():
    """``trainer.train(resume_from_checkpoint=True)`` on a wrapped transformers model: the steps
    after the checkpoint, the re-plans and the final weights equal those of a run that never
    stopped (the Trainer's own load puts rank 0's experts and optimizer state everywhere; the
    callback loads every rank's by logical id)."""
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback
    from moebalance.integrations.wrap import unwrap_state_dict
    from moebalance.lab.models import tiny_hf_moe

    rank, total, saved_at = dist.get_rank(), 6, 3

    def train(folder, steps, resume):
        model = mb.wrap(tiny_hf_moe("qwen3_moe", experts=8, seed=0).double(), TOPOLOGY)
        callback = RebalanceTrainerCallback(TOPOLOGY, every=2)
        args = transformers.TrainingArguments(
            output_dir=folder, max_steps=steps, per_device_train_batch_size=BATCH,
            learning_rate=3e-3, lr_scheduler_type="constant", report_to=[],
            save_strategy="steps", save_steps=saved_at, logging_strategy="no", use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
            train_sampling_strategy="sequential", average_tokens_across_devices=False)
        data = TextBatches(SEQ, BATCH, WORLD, rank, seed=4)
        rows = [{"input_ids": row, "labels": row} for step in range(total) for row in data(step)]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                       callbacks=[callback])
        losses = []
        model.register_forward_hook(lambda module, inputs, out: losses.append(float(out.loss)))
        trainer.train(resume_from_checkpoint=resume)
        return losses, unwrap_state_dict(model), [r["step"] for r in callback.rebalancer.history]

    # One output folder for every rank, as a user passes one path (transformers writes the
    # model from rank 0 of the process group alone).
    folders = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folders, group_src=0)
    straight, stopped = f"{folders[0]}/straight", f"{folders[0]}/stopped"
    losses, state, replans = train(straight, total, None)
    # A run stopped after the step-3 checkpoint leaves that folder behind: resuming it with
    # resume_from_checkpoint=True finds checkpoint-3 as its last.
    if rank == 0:
        shutil.copytree(f"{straight}/checkpoint-{saved_at}", f"{stopped}/checkpoint-{saved_at}")
    dist.barrier()
    resumed, resumed_state, resumed_replans = train(stopped, total, True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folders[0])
    np.testing.assert_allclose(resumed, losses[saved_at:], rtol=1e-12, atol=0)
    assert replans == resumed_replans == [2, 4, 6]
    for key, value in state.items():
        torch.testing.assert_close(resumed_state[key], value, rtol=1e-12, atol=1e-14)


def hf_trainer_loads_the_best_checkpoints_experts_at_end():
    """``load_best_model_at_end``: the Trainer loads the best checkpoint's dense weights; the
    callback loads its experts, so the model is that checkpoint's, not a mix of two steps."""
    import transformers

    from moebalance.integrations.hf import RebalanceTrainerCallback
    from moebalance.integrations.wrap import unwrap_state_dict
    from moebalance.lab.models import tiny_hf_moe

    rank = dist.get_rank()
    folders = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folders, group_src=0)
    model = mb.wrap(tiny_hf_moe("qwen3_moe", experts=8, seed=0).double(), TOPOLOGY)
    # The highest eval loss is "best": the first checkpoint, not the last.
    args = transformers.TrainingArguments(
        output_dir=folders[0], max_steps=4, per_device_train_batch_size=BATCH, learning_rate=3e-2,
        report_to=[], save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential", average_tokens_across_devices=False)
    data = TextBatches(SEQ, BATCH, WORLD, rank, seed=4)
    rows = [{"input_ids": row, "labels": row} for step in range(4) for row in data(step)]
    held_out = [{"input_ids": row, "labels": row}
                for row in TextBatches(SEQ, BATCH, WORLD, rank, seed=9)(0)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   eval_dataset=held_out,
                                   callbacks=[RebalanceTrainerCallback(TOPOLOGY, every=2)])
    try:
        trainer.train()
        best = trainer.state.best_model_checkpoint
        assert best is not None and best.endswith("checkpoint-2"), best
        saved = torch.load(f"{best}/moebalance_state.pt", weights_only=True)["experts"]["model"]
        now = unwrap_state_dict(model)
        experts = [key for key in now if ".experts." in key]
        assert experts and all(key in saved for key in experts)
        for key, value in now.items():
            if key in saved and value.is_floating_point():
                torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folders[0])


def lightning_ddp_resumes_from_its_checkpoint():
    """``fit(ckpt_path=...)`` under ``strategy="ddp"``: Lightning writes rank 0's checkpoint and
    restores its optimizer state on every rank; the callback puts every rank's experts and their
    optimizer state back by logical id, so the resumed steps equal a run that never stopped."""
    import os

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moebalance.integrations.lightning import RebalanceCallback
    from moebalance.nn import checkpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = small_model().double()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.lm(batch[:, :-1]), batch[:, 1:], BATCH * SEQ)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    saved_at, total = 3, 6
    # One epoch is saved_at steps: Lightning resumes a plain DataLoader at an epoch's start.
    rows = [row for r in range(WORLD) for step in range(saved_at)
            for row in TextBatches(SEQ, BATCH, WORLD, r, seed=2)(step)]
    folders = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folders, group_src=0)

    def fit(steps, ckpt_path=None, folder=None):
        module = Module()
        callback = RebalanceCallback(TOPOLOGY, every=2)
        saving = [ModelCheckpoint(dirpath=folder, every_n_train_steps=saved_at, save_top_k=-1)]
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=steps,
                            logger=False, enable_checkpointing=folder is not None,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[callback] + (saving if folder else []))
        sampler = torch.utils.data.DistributedSampler(rows, shuffle=False)
        trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler),
                    ckpt_path=ckpt_path)
        state = checkpoint.expert_state_dict(module, trainer.optimizers[0])
        return module.losses, state, [r["step"] for r in callback.rebalancer.history]

    # Spawned ranks join Lightning's DDP as torchrun's would (see examples/train_rebalance.py).
    os.environ["LOCAL_RANK"], os.environ["NODE_RANK"] = str(dist.get_rank()), "0"
    try:
        # the run that never stopped writes the checkpoint the resumed run starts from
        losses, state, replans = fit(total, folder=folders[0])
        resumed, resumed_state, resumed_replans = fit(
            total, ckpt_path=f"{folders[0]}/epoch=0-step={saved_at}.ckpt")
    finally:
        del os.environ["LOCAL_RANK"], os.environ["NODE_RANK"]
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folders[0])
    np.testing.assert_allclose(resumed, losses[saved_at:], rtol=1e-12, atol=0)
    assert replans == resumed_replans == [2, 4, 6]
    for key, value in state["model"].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(resumed_state["model"][key], value, rtol=1e-12, atol=1e-14)
    for fqn, entry in state["optimizer"]["state"].items():
        for name, value in entry["logical"].items():
            torch.testing.assert_close(resumed_state["optimizer"]["state"][fqn]["logical"][name],
                                       value, rtol=1e-12, atol=1e-16)


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


def compiled_model_trains_as_the_eager_one():
    """torch.compile(model): the MoE layers run as they are (graph breaks), the model around
    them compiled; losses, a migration and the weights as without compile."""
    results = []
    for compiled in (False, True):
        model = small_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rebalancer = mb.Rebalancer(model, TOPOLOGY, optimizer, every=EVERY)
        # aot_eager: dynamo's tracing and AOT autograd, without compiling C++ kernels
        run = torch.compile(model, backend="aot_eager") if compiled else model
        data = TextBatches(SEQ, BATCH, WORLD, dist.get_rank(), seed=1)
        losses = []
        for step in range(STEPS):
            batch = data(step)
            loss = lm_loss(run(batch[:, :-1]), batch[:, 1:], WORLD * BATCH * SEQ)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rebalancer.step()
            losses.append(float(loss))
        rebalancer.finish()
        check_migrated(rebalancer, model)
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (eager_losses, eager_params), (compiled_losses, compiled_params) = results
    np.testing.assert_allclose(compiled_losses, eager_losses, rtol=1e-5)
    for a, b in zip(compiled_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


CASES = [plain_loop_drives_a_migration, plain_loop_replans_when_moves_pay,
         compiled_model_trains_as_the_eager_one]
if importlib.util.find_spec("lightning") is not None:
    CASES.append(lightning_callback_drives_a_migration)
    CASES.append(lightning_weight_averaging_follows_the_migrations)
if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("accelerate"):
    CASES += [hf_trainer_callback_drives_a_migration, hf_trainer_resumes_from_its_own_checkpoint,
              hf_trainer_loads_the_best_checkpoints_experts_at_end]
if importlib.util.find_spec("lightning") is not None:
    CASES.append(lightning_ddp_resumes_from_its_checkpoint)   # last: it joins Lightning's DDP


dist_results = shared_spawn(CASES, __name__, world_size=WORLD, timeout_s=500.0,
                            collective_timeout_s=60.0,
                            preload=("transformers.trainer", "lightning"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_loop(dist_results, case):
    dist_results.check(case)


def test_hf_callback_refuses_a_resume_without_its_state_file(tmp_path):
    """A Trainer resumed from a checkpoint the callback did not write has loaded rank 0's
    experts and optimizer state everywhere: the callback refuses before training starts."""
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from moebalance.integrations.hf import RebalanceTrainerCallback

    (tmp_path / "checkpoint-5").mkdir()
    callback = RebalanceTrainerCallback(mb.Topology.uniform(num_devices=1, slots_per_device=4))
    with pytest.raises(ValueError,
                       match=r"moebalance_state\.pt .*checkpoint-5.*mb\.from_pretrained"):
        callback.on_train_begin(SimpleNamespace(max_grad_norm=1.0, output_dir=str(tmp_path)),
                                SimpleNamespace(global_step=5), SimpleNamespace(), model=None)


def test_hf_callback_refuses_fsdp_and_deepspeed_at_once(tmp_path):
    """Under torchrun the Trainer shards the model with fsdp= or deepspeed=, mixing the ranks'
    expert slots: the callback refuses when the Trainer is built, and again at train begin (a
    callback added later)."""
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from moebalance.integrations.hf import RebalanceTrainerCallback

    callback = RebalanceTrainerCallback(mb.Topology.uniform(num_devices=1, slots_per_device=4))
    sharded = TrainingArguments(output_dir=str(tmp_path), report_to=[], fsdp=True)
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=\.\.\.\) shards"):
        callback.on_init_end(sharded, SimpleNamespace(), SimpleNamespace())
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=\.\.\.\) shards"):
        callback.on_train_begin(sharded, SimpleNamespace(global_step=0), SimpleNamespace())
    with pytest.raises(ValueError, match=r"TrainingArguments\(deepspeed=\.\.\.\) shards"):
        callback.on_init_end(SimpleNamespace(fsdp=None, deepspeed="ds.json"), SimpleNamespace(),
                             SimpleNamespace())
    plain = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    callback.on_init_end(plain, SimpleNamespace(), SimpleNamespace())
