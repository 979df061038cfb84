"""Derived values, computed once from a validated config and read everywhere."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from engine.config.phases import phase_schedule
from parallel.mesh import Layout
from engine.config.schema import CRITIC_ESTIMATORS, ConfigError, TridentConfig
from engine.config.layout_check import _resolve_megatron, rollout_topology_of, validate_layout
from engine.config.checks import _fail, _options
from engine.config.validate import validate
from engine.rollout.registry import rollout_backend


# --------------------------------------------------------------------------------------------
# Derived values: the one place
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """How a rank cuts its rows into micro-batches: a sequence count, or a token budget
    (dynamic batching)."""
    micro_batch_size: Optional[int] = None
    max_tokens: Optional[int] = None

    def kwargs(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens}


def update_split(section) -> Split:
    """The update's micro-batches of an actor / critic section (ppo_* keys)."""
    if section.use_dynamic_bsz:
        return Split(max_tokens=section.ppo_max_token_len_per_gpu)
    return Split(micro_batch_size=section.ppo_micro_batch_size_per_gpu)


def forward_split(section) -> Split:
    """A forward-only pass's micro-batches (rollout / ref log_prob_* keys, resolved)."""
    if section.log_prob_use_dynamic_bsz:
        return Split(max_tokens=section.log_prob_max_token_len_per_gpu)
    return Split(micro_batch_size=section.log_prob_micro_batch_size_per_gpu)


@dataclass(frozen=True)
class BatchPlan:
    """How one trained model (actor or critic) splits a PPO step's batch."""
    mini_batch_size: int  # sequences per optimizer step over all DP ranks (= prompts x rollout.n)
    mini_batch_size_per_rank: int
    micro_batch_size_per_rank: Optional[int]  # None with use_dynamic_bsz (split by tokens)
    grad_accum_steps: Optional[int]  # micro-batches per mini-batch per rank; None with dynamic bsz
    mini_batches_per_epoch: int
    ppo_epochs: int
    update: Split = Split()  # micro-batches of an optimizer step


@dataclass(frozen=True)
class Derived:
    config: TridentConfig  # a copy with every null-means-auto key filled in
    layout: Layout
    rollout_batch_size: int  # sequences per PPO step (train_batch_size x rollout.n)
    rollout_batch_size_per_rank: int
    use_critic: bool
    use_reference: bool  # a KL term (loss or in-reward) needs reference log-probs
    actor: BatchPlan
    critic: Optional[BatchPlan]
    # forward-only passes by model: actor (old log-probs) and critic (values) follow the rollout
    # section's log_prob_* keys, ref its own, reward_model its micro_batch_size_per_gpu
    forward: dict = dataclasses.field(default_factory=dict)
    rollout_topology: Any = None  # engine.rollout.topology.RolloutTopology: engines, leaders, GPUs
    phases: Any = None  # engine.config.phases.PhaseSchedule: what is on the device in each phase


def total_training_steps(cfg: TridentConfig, dataset_len: int) -> int:
    """trainer.total_training_steps if set, else epochs x full batches (the last partial one is dropped)."""
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    batch = cfg.data.train_batch_size
    steps = (dataset_len // batch) * cfg.trainer.total_epochs
    if steps < 1:
        _fail("data.train_batch_size", batch, f"the training set has only {dataset_len} prompts, fewer than one "
              f"batch; lower data.train_batch_size to at most {dataset_len}")
    return steps


def derive(cfg: TridentConfig, world_size: Optional[int] = None, dataset_len: Optional[int] = None,
           cuda_available: Optional[bool] = None) -> Derived:
    """Validate the layout for `world_size` and compute every derived value.

    world_size: the launched rank count (default trainer.nnodes x n_gpus_per_node; must match it).
    dataset_len: training prompts; needed for total steps unless trainer.total_training_steps is set.
    cuda_available: resolves trainer.device='auto' (default: ask torch).
    """
    pool = cfg.trainer.rollout_pool_ranks if cfg.trainer.rollout_pool == "separate" else 0
    expected = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node - pool  # the training ranks
    world_size = expected if world_size is None else world_size
    if world_size != expected:
        _fail("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node,
              f"trainer.nnodes x n_gpus_per_node = {expected + pool}{f' less {pool} pool ranks' if pool else ''} "
              f"but {world_size} ranks were launched{' to train' if pool else ''}; "
              f"launch {expected + pool} ranks or set nnodes/n_gpus_per_node to match")
    validate(cfg)
    validate_layout(cfg, world_size)
    out = copy.deepcopy(cfg)
    arr, data, rollout = out.actor_rollout_ref, out.data, out.actor_rollout_ref.rollout
    actor, critic, trainer = arr.actor, out.critic, out.trainer

    # Devices and backends.
    if trainer.device == "auto":
        if cuda_available is None:
            import torch  # only here: the schema itself needs no torch
            cuda_available = torch.cuda.is_available()
        trainer.device = "cuda" if cuda_available else "cpu"
    try:  # 'auto' resolved and a backend the device cannot run refused: engine/rollout/registry.py
        rollout.name = rollout_backend(rollout.name, trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    # Values inherited from other keys.
    if data.filter_overlong_prompts or data.truncation == "filter":
        data.filter_overlong_prompts, data.truncation = True, "filter"
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    for section in (rollout, arr.ref):
        if section.log_prob_micro_batch_size_per_gpu is None:
            section.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
        if not section.log_prob_use_dynamic_bsz and section.log_prob_micro_batch_size_per_gpu is None:
            prefix = "actor_rollout_ref.rollout" if section is rollout else "actor_rollout_ref.ref"
            _fail(f"{prefix}.log_prob_micro_batch_size_per_gpu", None,
                  "set the per-rank log-prob micro-batch, or log_prob_use_dynamic_bsz=true")
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    critic.enable = out.algorithm.adv_estimator in CRITIC_ESTIMATORS if critic.enable is None else critic.enable
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    if critic.model.path is None and critic.model.config is None:
        critic.model.path, critic.model.config = arr.model.path, copy.deepcopy(arr.model.config)
        critic.model.tokenizer_path = critic.model.tokenizer_path or arr.model.tokenizer_path
    actor_megatron = _resolve_megatron(actor.megatron, actor.megatron)
    actor.megatron = actor_megatron
    for owner in (arr.ref, critic, out.reward_model):
        owner.megatron = _resolve_megatron(owner.megatron, actor_megatron)
    trainer.default_local_dir = (trainer.default_local_dir
                                 or f"checkpoints/{trainer.project_name}/{trainer.experiment_name}")
    trainer.log_dir = trainer.log_dir or f"logs/{trainer.project_name}/{trainer.experiment_name}"

    # Step counts and warmup.
    if dataset_len is not None or trainer.total_training_steps is not None:
        steps = total_training_steps(out, dataset_len if dataset_len is not None else 0)
        trainer.total_training_steps = steps
        for prefix, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", critic.optim)):
            if optim.total_training_steps not in (None, steps):
                _fail(f"{prefix}.total_training_steps", optim.total_training_steps,
                      f"is derived ({steps} steps); set trainer.total_training_steps instead and leave this null")
            optim.total_training_steps = steps
            if optim.lr_warmup_steps < 0:
                optim.lr_warmup_steps = int(optim.lr_warmup_steps_ratio * steps)

    # Batch arithmetic.
    m = actor_megatron
    layout = Layout(world_size=world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                    vpp=m.virtual_pipeline_model_parallel_size, cp=m.context_parallel_size,
                    ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size,
                    sequence_parallel=bool(m.sequence_parallel))
    rollout_batch = data.train_batch_size * rollout.n
    # generation hands each DP replica whole prompts (a prompt's n responses train on one
    # replica: engine/rollout/topology.route_plan), so the prompts, not the sequences, must split
    if data.train_batch_size % layout.dp:
        up = -(-data.train_batch_size // layout.dp) * layout.dp
        _fail("data.train_batch_size", data.train_batch_size,
              f"x rollout.n {rollout.n} = {rollout_batch} sequences, but each of the {layout.dp} data-parallel "
              f"ranks trains whole prompts (all n responses of a prompt) and {data.train_batch_size} prompts "
              f"do not split over {layout.dp} data-parallel ranks; make data.train_batch_size a multiple of "
              f"{layout.dp} (e.g. {up})")
    # a KL term, or DPO's implicit token reward (its log-ratio to the reference), needs the reference
    use_reference = (actor.use_kl_loss or out.algorithm.use_kl_in_reward
                     or out.reward_model.token_level == "implicit")
    return Derived(
        config=out, layout=layout, rollout_batch_size=rollout_batch,
        rollout_batch_size_per_rank=rollout_batch // layout.dp,
        use_critic=critic.enable,
        use_reference=use_reference,
        actor=_batch_plan(actor, "actor_rollout_ref.actor", out, layout.dp),
        critic=_batch_plan(critic, "critic", out, layout.dp) if critic.enable else None,
        forward={"actor": forward_split(rollout), "critic": forward_split(rollout), "ref": forward_split(arr.ref),
                 "reward_model": Split(micro_batch_size=out.reward_model.micro_batch_size_per_gpu)},
        rollout_topology=rollout_topology_of(out, world_size),
        phases=phase_schedule(out, critic.enable, use_reference))


def _batch_plan(section: Any, p: str, cfg: TridentConfig, dp: int) -> BatchPlan:
    n = cfg.actor_rollout_ref.rollout.n
    mini = section.ppo_mini_batch_size * n
    if mini % dp:
        _fail(f"{p}.ppo_mini_batch_size", section.ppo_mini_batch_size,
              f"x rollout.n {n} = {mini} sequences do not split over {dp} data-parallel ranks; make "
              f"ppo_mini_batch_size x rollout.n a multiple of {dp}")
    per_rank = mini // dp
    micro = None if section.use_dynamic_bsz else section.ppo_micro_batch_size_per_gpu
    if not section.use_dynamic_bsz and micro is None:
        _fail(f"{p}.ppo_micro_batch_size_per_gpu", None,
              f"set the per-rank micro-batch (sequences), or set {p}.use_dynamic_bsz=true")
    if micro is not None and per_rank % micro:
        _fail(f"{p}.ppo_micro_batch_size_per_gpu", micro,
              f"does not divide the per-rank mini-batch ({section.ppo_mini_batch_size} prompts x rollout.n {n} / "
              f"{dp} DP ranks = {per_rank} sequences); use {_options(per_rank)}")
    return BatchPlan(mini_batch_size=mini, mini_batch_size_per_rank=per_rank, micro_batch_size_per_rank=micro,
                     grad_accum_steps=None if micro is None else per_rank // micro,
                     mini_batches_per_epoch=cfg.data.train_batch_size // section.ppo_mini_batch_size,
                     ppo_epochs=section.ppo_epochs, update=update_split(section))

