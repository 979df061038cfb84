"""Layout validation: the parallel sizes against the world size and the model (one ConfigError
naming the key, the value and the fix), and the rollout topology they give."""
from __future__ import annotations

import copy
import math
from typing import Optional

from engine.config.schema import LAYOUT_KEYS, ConfigError, MegatronConfig, TridentConfig
from engine.config.checks import _fail, _options


# --------------------------------------------------------------------------------------------
# Layout validation
# --------------------------------------------------------------------------------------------

def _resolve_megatron(m: MegatronConfig, actor: MegatronConfig) -> MegatronConfig:
    """A ref/critic/reward-model megatron section with null layout keys taken from the actor."""
    out = copy.deepcopy(m)
    for name in LAYOUT_KEYS:
        if getattr(out, name) is None:
            setattr(out, name, getattr(actor, name))
    if out.expert_tensor_parallel_size is None:
        out.expert_tensor_parallel_size = out.tensor_model_parallel_size
    if out.params_dtype is None:  # the reference must see the actor's exact weights
        out.params_dtype = actor.params_dtype
    return out


def validate_layout(cfg: TridentConfig, world_size: int, num_layers: Optional[int] = None,
                    num_experts: Optional[int] = None, num_attention_heads: Optional[int] = None,
                    num_query_groups: Optional[int] = None) -> None:
    """Check the Megatron layout against `world_size` (and the model shape once it is known).

    num_experts: None = unknown, 0 = dense model. Raises ConfigError for the first violation.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: must be a positive int (the number of ranks)")
    p = "actor_rollout_ref.actor.megatron"
    actor = _resolve_megatron(cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor.megatron)
    tp, pp, cp = (actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size,
                  actor.context_parallel_size)
    ep, etp, vpp = (actor.expert_model_parallel_size, actor.expert_tensor_parallel_size,
                    actor.virtual_pipeline_model_parallel_size)
    # TP x PP x CP must divide the world: check each factor against what the previous ones leave.
    left, used = world_size, []
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp)):
        if left % size:
            given = "".join(f" with {k}={v}" for k, v in used)
            room = f" ({left} ranks left for it)" if used else ""
            _fail(f"{p}.{name}", size, f"does not divide world size {world_size}{given}{room}; "
                  f"use {_options(left)}")
        left //= size
        used.append((name, size))
    # Megatron's expert grid (expert-DP x EP x ETP) covers the TP x CP x DP ranks of each PP stage.
    stage = world_size // pp
    if stage % etp:
        _fail(f"{p}.expert_tensor_parallel_size", etp, f"does not divide world size {world_size} / "
              f"pipeline_model_parallel_size {pp} = {stage} ranks per stage; use {_options(stage)}")
    if stage % (ep * etp):
        _fail(f"{p}.expert_model_parallel_size", ep,
              f"expert_model_parallel_size x expert_tensor_parallel_size = {ep} x {etp} must divide world "
              f"size {world_size} / pipeline_model_parallel_size {pp} = {stage}; use "
              f"expert_model_parallel_size {_options(stage // etp)}")
    if vpp is not None:
        if pp < 2:
            _fail(f"{p}.virtual_pipeline_model_parallel_size", vpp,
                  "interleaving needs pipeline_model_parallel_size > 1; set it to null or raise PP")
        if num_layers is not None and num_layers % (pp * vpp):
            _fail(f"{p}.virtual_pipeline_model_parallel_size", vpp,
                  f"the model's {num_layers} layers do not split into pipeline_model_parallel_size {pp} x "
                  f"{vpp} chunks; choose PP x VPP dividing {num_layers}")
    # Megatron's rule: TP divides the attention heads; key/value groups a multiple or divisor of TP
    if num_attention_heads is not None and num_attention_heads % tp:
        _fail(f"{p}.tensor_model_parallel_size", tp, f"must divide the model's {num_attention_heads} "
              f"attention heads (each tensor-parallel rank holds whole heads); use "
              f"{_options(math.gcd(num_attention_heads, world_size))}")
    if num_query_groups is not None and num_query_groups % tp and tp % num_query_groups:
        _fail(f"{p}.tensor_model_parallel_size", tp, f"must be a multiple or a divisor of the model's "
              f"{num_query_groups} key/value heads; use {_options(math.gcd(num_query_groups, world_size))}")
    if num_layers is not None and num_layers % pp:
        _fail(f"{p}.pipeline_model_parallel_size", pp,
              f"the model's {num_layers} layers do not split evenly over {pp} stages; use a divisor of "
              f"{num_layers} that divides world size {world_size}")
    if num_experts is not None:
        if num_experts == 0 and ep > 1:
            _fail(f"{p}.expert_model_parallel_size", ep, "the model is dense (no experts); set it to 1")
        if num_experts > 0 and num_experts % ep:
            _fail(f"{p}.expert_model_parallel_size", ep,
                  f"must divide the model's {num_experts} experts; use a divisor of {num_experts}")
    for prefix, section in _megatron_sections(cfg):
        resolved = _resolve_megatron(section, actor)
        if section is not cfg.actor_rollout_ref.actor.megatron:
            for name in LAYOUT_KEYS:  # one process-group layout per process: all models share it
                if getattr(resolved, name) != getattr(actor, name):
                    _fail(f"{prefix}.{name}", getattr(section, name),
                          f"differs from {p}.{name}={getattr(actor, name)!r}; all models share the actor's "
                          "Megatron layout: set it to null (same as the actor)")
        if resolved.sequence_parallel and resolved.tensor_model_parallel_size < 2:
            _fail(f"{prefix}.sequence_parallel", True, "needs tensor_model_parallel_size > 1 (it is "
                  f"{resolved.tensor_model_parallel_size}); set sequence_parallel=false or raise TP")
        if num_experts and tp > 1 and not resolved.sequence_parallel:
            _fail(f"{prefix}.sequence_parallel", resolved.sequence_parallel,
                  f"an MoE model ({num_experts} experts) with tensor_model_parallel_size={tp} needs "
                  "sequence parallelism in Megatron; set sequence_parallel=true")
    rollout_topology_of(cfg, world_size, num_attention_heads)


def rollout_topology_of(cfg: TridentConfig, world_size: int, num_attention_heads: Optional[int] = None):
    """The rollout groups of `cfg` at `world_size` training ranks (engine/rollout/topology.py):
    over those ranks when colocated, over the pool's ranks when separate."""
    from engine.rollout.topology import TopologyError, rollout_topology
    if cfg.trainer.rollout_pool == "separate":
        world_size = cfg.trainer.rollout_pool_ranks
    try:
        return rollout_topology(world_size, cfg.trainer.n_gpus_per_node,
                                cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                                num_attention_heads=num_attention_heads)
    except TopologyError as e:
        raise ConfigError(str(e)) from None


def _megatron_sections(cfg: TridentConfig) -> list[tuple[str, MegatronConfig]]:
    return [("actor_rollout_ref.actor.megatron", cfg.actor_rollout_ref.actor.megatron),
            ("actor_rollout_ref.ref.megatron", cfg.actor_rollout_ref.ref.megatron),
            ("critic.megatron", cfg.critic.megatron),
            ("reward_model.megatron", cfg.reward_model.megatron)]


