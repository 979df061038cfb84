"""The colocated memory schedule: for every phase of a PPO step, which state of which model is
on the device, and which part of the rollout engine's memory. One object, derived once from the
config; the trainer executes it (engine/rollout/colocated.py) and tools/plan.py computes each phase's peak
from it, so the plan describes the schedule that runs.

A model keeps on the device, in every phase, whatever its `megatron.*_offload` switches leave
there; what they offload comes back only for the phases that use it: the parameters for the
model's forward passes, parameters + gradients + optimizer state for its update. The actor's
parameters are on the device while its weights are sent to the rollout.

The sync into a colocated rollout engine runs in this order (`SYNC_ORDER`): the training
gradients and optimizer state go first, then the rollout takes its weights memory back, the
weights are sent, the actor's parameters go (when `param_offload`), and only then does the
rollout take its KV cache back. After generation it gives both back (unless
`rollout.free_cache_engine=false`, which keeps them through training) as soon as a model needs
the device: rule rewards run on the host, so without a reward model the rollout keeps its memory
through the reward phase (dynamic sampling's next generation needs no new sync).

Phase names are verl's timer names (`PHASE_NAMES`: the schedule's phases plus `adv`, which
moves no memory): the memory schedule, the step's timers (`timing_s/<name>`), the launcher's
reports and fault injection all use them (engine/experience/context.py StepContext.phase).

Storage a model offloads is freed into torch's caching allocator, where the rollout's processes
cannot use it: before the rollout resumes weights or KV cache, training hands its cache back to
the device (`cache_emptied`; engine/rollout/colocated.py, parallel/device_memory.py). Between two such points
the training process keeps reserved the most it allocated, which tools/plan.py reports per phase
beside what is allocated. The engines are built before the training models (engine/train.py),
so SGLang's KV pool is mem_fraction_static x the free device less the weights.

Tests: tests/test_phases.py, tests/test_plan.py, tests/test_device_memory.py
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.rollout.base import ROLLOUT_MEMORY

PHASES = ("update_weights", "gen", "reward", "old_log_prob", "ref", "values", "update_critic",
          "update_actor", "testing", "save_checkpoint")
# every phase a step runs, in step order: the schedule's and the advantage computation (host only)
PHASE_NAMES = PHASES[:6] + ("adv",) + PHASES[6:]
STATES = ("params", "grads", "optimizer")
# the model that runs in a phase, and whether it trains there
RUNS = {"update_weights": ("actor", False), "reward": ("reward_model", False), "old_log_prob": ("actor", False),
        "ref": ("ref", False), "values": ("critic", False), "update_critic": ("critic", True),
        "update_actor": ("actor", True)}
ROLLOUT_PHASES = ("update_weights", "gen", "testing")
OFFLOAD_SWITCH = {"params": "param_offload", "grads": "grad_offload", "optimizer": "optimizer_offload"}
SAVED = ("actor", "critic")  # what a checkpoint holds: every state of these is read while saving
SYNC_ORDER = ("offload training grads and optimizer state", "empty training's cache",
              "resume rollout weights", "send weights", "offload actor params (param_offload)",
              "empty training's cache", "resume rollout KV cache")


@dataclass(frozen=True)
class PhaseSchedule:
    models: dict        # model -> the states it has ('params' only for frozen models)
    offloaded: dict     # model -> the states its config offloads while no phase needs them
    keep_rollout: bool  # rollout.free_cache_engine=false: the rollout never gives memory back

    def resident(self, phase: str, model: str) -> frozenset:
        """States of `model` on the device during `phase`."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        has = frozenset(self.models[model])
        keep = has - self.offloaded[model]
        runner, trains = RUNS.get(phase, (None, False))
        if runner == model or (phase == "save_checkpoint" and model in SAVED):
            keep |= has if trains or phase == "save_checkpoint" else {"params"}
        return keep

    def rollout(self, phase: str) -> frozenset:
        """Rollout memory on the device during `phase` (the sync ends with both)."""
        host_reward = phase == "reward" and "reward_model" not in self.models  # nothing needs the device
        if self.keep_rollout or phase in ("gen", "testing") or host_reward:
            return frozenset(ROLLOUT_MEMORY)
        return frozenset({"weights"}) if phase == "update_weights" else frozenset()

    def cache_emptied(self, phase: str) -> bool:
        """Whether training's cached memory goes back to the device as `phase` begins: where the
        rollout resumes memory (the sync, then generation; validation starts with a sync)."""
        return not self.keep_rollout and phase in ROLLOUT_PHASES

    def reserved(self, allocated: dict) -> dict:
        """{phase: bytes the training process reserves} from {phase: bytes it allocates} (phases
        missing: nothing runs there): the most allocated since the cache was last emptied, in
        step order; two steps walked, so a cache never emptied carries the previous step's peak.
        Validation runs on some steps only: the phases after it are counted as on a step without."""
        out, held = {}, 0.0
        for _ in range(2):
            for phase in (p for p in PHASES if p in allocated):
                if phase == "testing" and self.cache_emptied(phase):
                    out[phase] = allocated[phase]
                    continue
                held = allocated[phase] if self.cache_emptied(phase) else max(held, allocated[phase])
                out[phase] = held
        return out

    def table(self) -> dict:
        """{phase: {model: [states]}, 'rollout': [...]} for printing and JSON."""
        return {p: dict({m: sorted(self.resident(p, m)) for m in self.models},
                        rollout=sorted(self.rollout(p))) for p in PHASES}


def phase_schedule(cfg, use_critic: bool, use_reference: bool) -> PhaseSchedule:
    """The schedule of a resolved config (`Derived.config`)."""
    arr = cfg.actor_rollout_ref
    sections = {"actor": (arr.actor.megatron, STATES)}
    if use_critic:
        sections["critic"] = (cfg.critic.megatron, STATES)
    if use_reference:
        sections["ref"] = (arr.ref.megatron, ("params",))
    if cfg.reward_model.enable:
        sections["reward_model"] = (cfg.reward_model.megatron, ("params",))
    models, offloaded = {}, {}
    for name, (m, states) in sections.items():
        models[name] = tuple(states)
        # only the switches of the states the model has (a frozen model's grad / optimizer
        # switches are refused by validation, never read here)
        offloaded[name] = frozenset(s for s in states if getattr(m, OFFLOAD_SWITCH[s]))
    return PhaseSchedule(models, offloaded, keep_rollout=not arr.rollout.free_cache_engine)
