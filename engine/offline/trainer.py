"""The offline trainers (reward model, DPO, SFT) on the loop shell (engine/loop.py): batches of
preference pairs or conversations -> one update per mini-batch -> held-out metrics, checkpoints
(resumable like PPO) and the HF export.

Each DP rank trains on its contiguous share of a step's examples; held-out examples are spread
over the DP ranks (padded with weight-0 repeats so every rank runs the same schedule) and their
metrics summed over DP, so `val/*` is the whole held-out set's mean whatever the layout (per
example, or per loss token for SFT: `eval_count`).

A task defines update(batch, timings) (its model's update on this rank's examples), eval_sums
(weighted held-out sums), make_batch (examples -> a Batch; pairs by default), eval_count (what
the sums are divided by; the examples by default) and export_config (the HF config of its export).

Tests: tests/test_offline_trainers.py, tests/test_offline_pipeline.py, tests/test_loop.py,
tests/test_sft.py
"""
import math
import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.pair_losses import bradley_terry_loss, dpo_loss
from engine.data.preference import PairLoader, pair_batch
from engine.data.sft import sft_batch
from engine.loop import Loop
from engine.metrics import Timer, compute_throughput_metrics
from engine.workers.pairs import sequence_log_probs
from engine.workers.sft import masked_nll_sum


class OfflineTrainer(Loop):
    worker_name = "actor"  # the checkpoint directory of the trained model
    rows_per_example = 2  # a preference pair is two sequences (chosen, rejected)
    make_batch = staticmethod(pair_batch)  # examples, pad id -> the model's Batch

    def __init__(self, derived, *, tokenizer, hf_config, train_data, val_data, model, pad_id,
                 checkpoints=None):
        super().__init__(derived.config, checkpoints=checkpoints)
        cfg = self.cfg
        self.tokenizer, self.hf_config, self.model = tokenizer, hf_config, model
        self.train_data, self.val_data = train_data, val_data
        self.pad_id = pad_id  # the run's, decided once by the builder (engine/offline/build.py)
        self.loader = PairLoader(train_data, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                 seed=cfg.data.seed, prefetch=cfg.data.dataloader_num_workers)
        self.mini_size = derived.actor.mini_batch_size_per_rank
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.forward = derived.forward  # forward-only splits by model (sequences)

    # -- what a task defines ----------------------------------------------------------------
    def update(self, batch, timings):
        """The trained model's update on this rank's pairs; returns its metrics."""
        raise NotImplementedError

    def eval_sums(self, batch, weight):
        """name -> weighted sum over this rank's held-out examples (weight: [examples])."""
        raise NotImplementedError

    def eval_count(self, batch, weight):
        """What the held-out sums are divided by once summed over DP: the examples."""
        return weight.double().sum()

    def export_config(self):
        return self.hf_config

    # -- the loop's hooks (engine/loop.py) ----------------------------------------------------
    def workers(self):
        return {self.worker_name: self.model}

    def start(self):
        if self.checkpoints is not None:
            self._write_hf_config()

    def next_batch(self):
        """The step's pairs, and the step's timings (timing_s/step counts the wait for them)."""
        timings = {}
        with Timer("step", timings):
            examples = self.loader.next_batch()
        return examples, timings

    def train_step(self, batch):
        examples, timings = batch
        with Timer("step", timings):
            per = len(examples) // self.dp
            batch = self.make_batch(examples[self.dp_rank * per:(self.dp_rank + 1) * per],
                                    self.pad_id)
            metrics = self.update(batch, timings)
        metrics.update(timings)
        metrics.update(self.train_data.metrics)
        metrics.update(self._throughput(batch, timings["timing_s/step"]))
        return metrics

    def _forward_split(self, model):
        """A forward-only pass's micro-batches (derive's: rollout.log_prob_* keys for the
        trained model, ref.* for the reference) in sequences: the keys count examples here."""
        split = self.forward[model]
        if split.max_tokens is not None:
            return dict(max_tokens=split.max_tokens)
        return dict(micro_batch_size=self.rows_per_example * split.micro_batch_size)

    def _throughput(self, batch, seconds):
        tokens = torch.tensor([float(batch["attention_mask"].sum())])
        dist.all_reduce(tokens, group=ps.get_data_parallel_group())
        return compute_throughput_metrics(float(tokens), seconds, self.world)

    def validate(self):
        """`val/*`: the held-out examples' mean metrics (every rank returns the same)."""
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        n = len(self.val_data)
        per = math.ceil(n / self.dp)
        picks = [i if i < n else i % n for i in range(self.dp_rank * per, (self.dp_rank + 1) * per)]
        weight = torch.tensor([1.0 if i < n else 0.0
                               for i in range(self.dp_rank * per, (self.dp_rank + 1) * per)])
        batch = self.make_batch([self.val_data[i] for i in picks], self.pad_id)
        sums = self.eval_sums(batch, weight.double())
        names = sorted(sums)
        t = torch.stack([sums[k].double() for k in names] + [self.eval_count(batch, weight)])
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return {f"val/{k}": float(v / t[-1]) for k, v in zip(names, t[:-1])}

    # -- export ------------------------------------------------------------------------------
    def _write_hf_config(self):
        """`default_local_dir/hf_config`: the config (+ tokenizer) that
        `tools/convert_checkpoint.py mcore-to-hf --hf-config` needs to export a checkpoint of
        this run (global_step_N/<worker>) as a HF model."""
        out = os.path.join(self.cfg.trainer.default_local_dir, "hf_config")
        if self.rank == 0 and not os.path.exists(out):
            self.export_config().save_pretrained(out)
            self.tokenizer.save_pretrained(out)
        dist.barrier()

    def export_hf(self):
        """HF weights of the trained model at default_local_dir/hf/step_N (trainer.save_hf)."""
        from engine.models.hf_io import save_hf_weights
        out = os.path.join(self.cfg.trainer.default_local_dir, "hf", f"step_{self.step_count}")
        source = self.cfg.actor_rollout_ref.model.path
        if self.rank == 0:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            if os.path.isdir(out):  # a re-run of the same steps (resume_mode=disable) replaces it
                shutil.rmtree(out)
        dist.barrier()
        save_hf_weights(self.model.chunks, self.export_config(), out, source_dir=source)
        if self.rank == 0 and not source:  # a built-in task's (or inline model's) tokenizer
            self.tokenizer.save_pretrained(out)
        dist.barrier()
        if self.rank == 0:
            print(f"wrote HF model {out}", flush=True)
        return out


class RewardModelTrainer(OfflineTrainer):
    """Bradley-Terry reward model; exported as a HF sequence-classification model."""

    worker_name = "reward_model"

    def update(self, batch, timings):
        with Timer("update_reward_model", timings):
            return self.model.update_pairs(batch, self.mini_size)

    def eval_sums(self, batch, weight):
        scores = self.model.compute_scores(batch, **self._forward_split("actor")).double()
        chosen, rejected = scores[0::2], scores[1::2]
        margin = batch["pair_margin"][0::2].double() if "pair_margin" in batch else None
        return {"loss": (weight * bradley_terry_loss(chosen, rejected, margin)).sum(),
                "accuracy": (weight * (chosen > rejected).double()).sum(),
                "margin": (weight * (chosen - rejected)).sum()}

    def export_config(self):
        from engine.models.hf_io import sequence_classification_config
        return sequence_classification_config(self.hf_config, self.pad_id)


class DPOTrainer(OfflineTrainer):
    """DPO against the initial policy (a ReferenceWorker) or precomputed reference columns."""

    def __init__(self, derived, *, ref=None, **kw):
        super().__init__(derived, **kw)
        self.ref = ref
        self.dpo = self.cfg.algorithm.dpo
        self._val_ref = None  # frozen reference, same held-out share each time: computed once

    def _ref_logps(self, batch):
        return sequence_log_probs(self.ref, batch, **self._forward_split("ref"))

    def update(self, batch, timings):
        if "ref_logps" not in batch:
            with Timer("ref", timings):
                batch["ref_logps"] = self._ref_logps(batch)
        with Timer("update_actor", timings):
            return self.model.update_pairs(batch, self.mini_size)

    def eval_sums(self, batch, weight):
        if "ref_logps" not in batch:
            if self._val_ref is None:
                self._val_ref = self._ref_logps(batch)
            batch["ref_logps"] = self._val_ref
        policy = sequence_log_probs(self.model, batch, **self._forward_split("actor")).double()
        ref = batch["ref_logps"].double()
        losses, chosen_r, rejected_r = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2],
                                                self.dpo.beta, self.dpo.loss_type)
        return {"loss": (weight * losses).sum(),
                "rewards/chosen": (weight * chosen_r).sum(),
                "rewards/rejected": (weight * rejected_r).sum(),
                "rewards/accuracies": (weight * (chosen_r > rejected_r).double()).sum(),
                "rewards/margins": (weight * (chosen_r - rejected_r)).sum(),
                # the policy's own preference: log pi(chosen) > log pi(rejected)
                "logps/accuracies": (weight * (policy[0::2] > policy[1::2]).double()).sum()}


class SFTTrainer(OfflineTrainer):
    """Supervised fine-tuning on conversations (engine/data/sft.py, engine/workers/sft.py);
    verl's SFT metric names: `train/loss`, `train/grad_norm`, `train/lr`, `train/global_tokens`
    (every token of the step's conversations), `train/loss_tokens` (the assistant's), and
    `val/loss`, the held-out token-mean NLL over every held-out assistant token."""

    rows_per_example = 1
    make_batch = staticmethod(sft_batch)
    renamed = {"loss": "train/loss", "actor/grad_norm": "train/grad_norm", "actor/lr": "train/lr",
               "actor/skipped_updates": "train/skipped_updates",
               "actor/oom_retries": "train/oom_retries"}

    def update(self, batch, timings):
        with Timer("update_actor", timings):
            out = self.model.update_sft(batch, self.mini_size)
        metrics = {self.renamed.get(k, k): v for k, v in out.items()}
        counts = torch.tensor([float(batch["attention_mask"].sum()),
                               float(batch["response_mask"].sum())])
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        metrics["train/global_tokens"], metrics["train/loss_tokens"] = counts.tolist()
        return metrics

    def eval_sums(self, batch, weight):
        lp = self.model.compute_log_prob(batch, **self._forward_split("actor")).double()
        return {"loss": masked_nll_sum(lp, batch["response_mask"].double() * weight[:, None])}

    def eval_count(self, batch, weight):
        return (batch["response_mask"].double() * weight[:, None]).sum()
