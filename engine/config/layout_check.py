"""Layout validation: the recipe's Megatron sizes against the world size and the model (one
ConfigError naming the key, the value and the fix), and the rollout topology they give.

The rules themselves are parallel/mesh.py's (`Layout.check`, which knows nothing about RL);
this module maps the recipe onto a `Layout`, names the sizes by their keys, and adds the one
rule a recipe has beyond a layout: every model shares the actor's layout.

Tests: tests/test_config.py, tests/test_mesh_layout.py, tests/test_rollout_topology.py
"""
from __future__ import annotations

from typing import Optional

from engine.config.checks import fail
from engine.config.devices import layout_of, rollout_topology_of
from engine.config.inherit import resolve_megatron
from engine.config.schema import LAYOUT_KEYS, MegatronConfig, TridentConfig
from parallel.mesh import LayoutError

__all__ = ["MEGATRON_NAMES", "validate_layout", "megatron_sections"]

ACTOR_MEGATRON = "actor_rollout_ref.actor.megatron"
# Layout's sizes by their recipe keys (under <model>.megatron)
MEGATRON_NAMES = {"world_size": "world_size", "tp": "tensor_model_parallel_size",
                  "pp": "pipeline_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_model_parallel_size",
                  "etp": "expert_tensor_parallel_size", "sequence_parallel": "sequence_parallel"}


def validate_layout(cfg: TridentConfig, world_size: int, num_layers: Optional[int] = None,
                    num_experts: Optional[int] = None, num_attention_heads: Optional[int] = None,
                    num_query_groups: Optional[int] = None) -> None:
    """Check the Megatron layout against `world_size` (and the model shape once it is known).

    num_experts: None = unknown, 0 = dense model. Raises ConfigError for the first violation.
    """
    try:
        layout_of(cfg, world_size).check(world_size, num_layers=num_layers, num_experts=num_experts,
                                         num_attention_heads=num_attention_heads,
                                         num_query_groups=num_query_groups, names=MEGATRON_NAMES)
    except LayoutError as e:
        key = "world_size" if e.size == "world_size" else f"{ACTOR_MEGATRON}.{MEGATRON_NAMES[e.size]}"
        fail(key, e.value, e.fix)
    actor = resolve_megatron(cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor.megatron)
    for prefix, section in megatron_sections(cfg)[1:]:
        resolved = resolve_megatron(section, actor)
        for name in LAYOUT_KEYS:  # one process-group layout per process: all models share it
            if getattr(resolved, name) != getattr(actor, name):
                fail(f"{prefix}.{name}", getattr(section, name),
                     f"differs from {ACTOR_MEGATRON}.{name}={getattr(actor, name)!r}; all models share the "
                     "actor's Megatron layout: set it to null (same as the actor)")
    rollout_topology_of(cfg, world_size, num_attention_heads)


def megatron_sections(cfg: TridentConfig) -> list[tuple[str, MegatronConfig]]:
    """(key prefix, section) of every model's megatron section, the actor's first."""
    return [(ACTOR_MEGATRON, cfg.actor_rollout_ref.actor.megatron),
            ("actor_rollout_ref.ref.megatron", cfg.actor_rollout_ref.ref.megatron),
            ("critic.megatron", cfg.critic.megatron),
            ("reward_model.megatron", cfg.reward_model.megatron)]


