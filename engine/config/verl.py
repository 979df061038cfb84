"""verl's keys that are not Trident's keys as they stand: FSDP's (`fsdp_config.*`, Ulysses, the
reward model's `strategy`), vLLM's rollout switches, the per-role `profiler` sections, and a few
more a verl recipe carries.
(`strategy` of the actor, reference and critic is Trident's own key: megatron | fsdp | fsdp2.)

Each key gets exactly one line, never a list of a section's keys:
- read as Trident's own key(s) (`alias`): one note in the log;
- at a value that asks for what Trident does anyway (`same`): accepted, one note saying why
  nothing is set (none for `strategy: megatron`, which is simply what runs);
- any other value: refused, one line naming the key, the value and what to use instead.

`resolve(key, value)` answers for one key (a section such as `fsdp_config` yields one answer per
key inside it); engine/config/load.py applies the answers, gathers the refusals of a whole recipe
into one error and logs the notes once the recipe validates. ALIASES and MOVED_KEYS in
engine/config/schema.py are verl's renamed keys; this module is for keys with no Trident name
(a key the schema gains leaves KEYS: its refusal would shadow it; tests/test_verl_configs.py checks).

Tests: tests/test_verl_configs.py, tests/test_config_keys.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

ANY = None  # `same=ANY`: every value asks for what Trident does (the key has no meaning here)


@dataclass(frozen=True)
class VerlKey:
    fix: str = ""                       # refused values: what to use instead
    same: Union[tuple, Callable, None] = ()  # accepted values (a tuple, a predicate, or ANY)
    note: str = ""                      # why an accepted value sets nothing ("" : no note)
    alias: tuple = ()                   # Trident keys the value is read as
    alias_if: Optional[Callable] = None  # alias only for values it accepts (else `same` / `fix`)
    same_note: str = ""                 # the note for an accepted value of a conditional alias

    def accepts(self, value: Any) -> bool:
        if self.same is ANY:
            return True
        if callable(self.same):
            return self.same(value)
        return any(value == s and type(value) is type(s) for s in self.same)


@dataclass(frozen=True)
class Answer:
    kind: str           # "alias" | "note" | "refuse" | "accept" (a Trident key at a value it takes)
    key: str            # the verl key (a leaf)
    value: Any
    line: str = ""      # the note or the refusal
    targets: tuple = ()  # alias: the Trident keys to set


# The sections that carry verl's FSDP keys, their Megatron section here, and whether the model
# trains (the reference and the reward model are frozen: no gradients, no optimizer).
FSDP_SECTIONS = {
    "actor_rollout_ref.actor": ("actor_rollout_ref.actor.megatron", True),
    "actor_rollout_ref.ref": ("actor_rollout_ref.ref.megatron", False),
    "critic.model": ("critic.megatron", True),
    "reward_model.model": ("reward_model.megatron", False),
}
ROLLOUT = "actor_rollout_ref.rollout"
CORRECTION = "algorithm.rollout_correction"
# the reward model's scoring runs on Megatron-core's layout only
RM_STRATEGY = VerlKey(same=("megatron",), fix="the reward model scores with Megatron-core's layout "
                      "(reward_model.megatron.*; it shares the actor's parallel sizes); remove it or set megatron")


def _fsdp(meg: str, trains: bool) -> dict[str, VerlKey]:
    frozen = "the model is frozen (no gradients, no optimizer)"
    fsdp_only = "(read under strategy fsdp / fsdp2; with megatron, validation refuses a non-default value)"
    offloads = (f"{meg}.param_offload", f"{meg}.grad_offload", f"{meg}.optimizer_offload") if trains \
        else (f"{meg}.param_offload",)
    out = {
        "param_offload": VerlKey(
            alias=(f"{meg}.param_offload",) + ((f"{meg}.grad_offload",) if trains else ()),
            note=f"read as {meg}.param_offload" + (" and grad_offload (Megatron keeps a gradient "
                                                    "buffer that FSDP frees after each step)" if trains else "")),
        "offload_policy": VerlKey(
            alias=offloads, alias_if=lambda v: v is True,
            note=f"FSDP2's CPU offload policy read as {', '.join(offloads)}: the states wait on the host "
                 "while the model is idle and come back for its phase (the optimizer step runs on the "
                 "device, not on the CPU as FSDP2's policy runs it)",
            same=(False,), same_note="FSDP2's CPU offload policy off, as here", fix="expected true or false"),
        "reshard_after_forward": VerlKey(
            alias=(f"{meg}.reshard_after_forward",), note=f"read as {meg}.reshard_after_forward {fsdp_only}"),
        "forward_prefetch": VerlKey(
            alias=(f"{meg}.forward_prefetch",), note=f"read as {meg}.forward_prefetch {fsdp_only}"),
        "fsdp_size": VerlKey(
            same=(-1,), note="strategy fsdp / fsdp2 shard over all data-parallel ranks, as -1 asks",
            fix="sharding over groups smaller than data parallel (HSDP) is not here: the fully sharded "
                "strategies shard over all DP ranks; set -1 (or remove it)"),
        "wrap_policy": VerlKey(
            same=ANY, note="the fully sharded strategies wrap each transformer layer, the embedding and "
                           "RoPE (Megatron-core's units); the rest is the root unit"),
    }
    out["optimizer_offload"] = (VerlKey(alias=(f"{meg}.optimizer_offload",), note=f"read as {meg}.optimizer_offload")
                                if trains else
                                VerlKey(same=(False,), note=f"{frozen}, nothing to offload",
                                        fix=f"{frozen}; remove it ({meg}.param_offload offloads its weights)"))
    return out


def _ulysses(meg: str) -> VerlKey:
    return VerlKey(same=(1,), note="Ulysses sequence parallelism is off, as here",
                   fix=f"Ulysses sequence parallelism is FSDP's; Megatron-core splits long sequences over "
                       f"{meg}.context_parallel_size (and sequence_parallel with TP); remove it")


def _dummy(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("dummy")


KEYS: dict[str, VerlKey] = {
    "reward_model.strategy": RM_STRATEGY,
    **{f"{s}.ulysses_sequence_parallel_size": _ulysses(meg) for s, (meg, _) in FSDP_SECTIONS.items()
       if not s.endswith(".model")},
    "critic.ulysses_sequence_parallel_size": _ulysses("critic.megatron"),
    "reward_model.ulysses_sequence_parallel_size": _ulysses("reward_model.megatron"),
    # vLLM's engine switches (the rollout keys Trident shares with verl are in its schema)
    f"{ROLLOUT}.load_format": VerlKey(
        same=_dummy, note="the rollout engine starts without the checkpoint and receives the actor's "
                          "weights before it generates, as dummy* asks",
        fix="the rollout engine always starts with dummy weights and receives the actor's before it "
            "generates (nothing is loaded from disk); remove it"),
    f"{ROLLOUT}.max_model_len": VerlKey(
        same=(None,), note="each engine's context is prompt_length + response_length, as null asks",
        fix=f"each engine's context is {ROLLOUT}.prompt_length + response_length (data.max_prompt_length + "
            "max_response_length by default); remove it and set those"),
    # verl's rollout-correction switches that pick another loss or skip the old-log-prob pass
    f"{CORRECTION}.use_policy_gradient": VerlKey(
        same=(False,), note="PPO's clipped loss trains, as false asks",
        fix="PPO's clipped loss trains (actor_rollout_ref.actor.policy_loss picks another); remove it"),
    f"{CORRECTION}.loss_type": VerlKey(
        same=("ppo_clip",), note="PPO's clipped loss trains, as ppo_clip asks",
        fix="PPO's clipped loss trains, in bypass mode too (actor_rollout_ref.actor.policy_loss "
            "picks another); remove it"),
    # verl's DAPO recipes switch the penalty's logging; Trident always logs it
    "reward_model.overlong_buffer.log": VerlKey(
        same=ANY, note="the overlong penalty is always logged (reward_extra/overlong_reward/mean, "
                       "reward_extra/overlong/mean)"),
    "trainer.critic_warmup": VerlKey(
        same=(0,), note="the actor trains from the first step, as 0 asks",
        fix="no critic-only warm-up steps yet: the actor trains from the first step; remove it (or start "
            "from a critic trained beforehand: critic.model.path)"),
}


# verl's per-role profiler switches; Trident profiles whole steps on every rank (global_profiler)
PROFILER_SECTIONS = tuple(f"{s}.profiler" for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                                     "actor_rollout_ref.rollout", "critic", "reward_model"))
PROFILER_FIX = ("Trident profiles whole steps, every rank and role at once: set global_profiler.tool=torch "
                "and global_profiler.steps (engine/profiler.py), and remove it or set enable=false")


def _profiler_section(key: str) -> Optional[str]:
    return next((s for s in PROFILER_SECTIONS if key == s or key.startswith(s + ".")), None)


def _profiler(key: str, value: Any) -> Iterator[Answer]:
    """A role's `profiler` section (one line for it) or one of its keys (one line each)."""
    section = _profiler_section(key)
    if key == section and value is not None and not isinstance(value, dict):
        yield Answer("refuse", key, value, f"{key}={value!r}: expected a mapping of verl's profiler keys; "
                                           f"remove it ({PROFILER_FIX})")
        return
    if key == section:
        enable = (value or {}).get("enable", False)
    else:  # one key of the section: only `enable` can switch the role's profiler on
        enable = value if key.endswith(".enable") else False
    if enable is True:
        yield Answer("refuse", key, value, f"{key}={value!r}: {PROFILER_FIX}")
    elif enable is False:
        yield Answer("note", key, value, f"config: {key} is verl's per-role profiler, off here: ignored "
                                         "(global_profiler.* profiles whole steps)")
    else:
        yield Answer("refuse", key, value, f"{key}={value!r}: expected true or false")


def _fsdp_key(key: str) -> Optional[tuple[str, VerlKey]]:
    """(section, entry) for `<section>.fsdp_config.<name>`; an unknown name gets the generic line."""
    for section, (meg, trains) in FSDP_SECTIONS.items():
        head = f"{section}.fsdp_config."
        if key.startswith(head):
            name = key[len(head):]
            return section, _fsdp(meg, trains).get(name) or VerlKey(
                fix=f"an FSDP setting of verl's that Trident does not act on (the fully sharded strategies "
                    f"read param_offload, optimizer_offload, offload_policy, reshard_after_forward, "
                    f"forward_prefetch, fsdp_size, wrap_policy; this model's settings are {meg}.*); remove it")
    return None


def is_fsdp_section(key: str) -> bool:
    return any(key == f"{section}.fsdp_config" for section in FSDP_SECTIONS)


def handles(key: str) -> bool:
    """Whether `key` (dotted) is one of verl's keys this module answers for."""
    return key in KEYS or is_fsdp_section(key) or _fsdp_key(key) is not None or _profiler_section(key) is not None


def resolve(key: str, value: Any, in_schema: bool) -> Iterator[Answer]:
    """What to do with verl's `key`=`value` (`in_schema`: Trident has a key of that name)."""
    if _profiler_section(key):
        yield from _profiler(key, value)
        return
    if is_fsdp_section(key):
        if value is None:  # an empty section
            return
        if not isinstance(value, dict):
            yield Answer("refuse", key, value, f"{key}={value!r}: expected a mapping of verl's FSDP keys; "
                                               "remove it (Trident trains with Megatron-core)")
            return
        for name, sub in value.items():
            yield from resolve(f"{key}.{name}", sub, False)
        return
    fsdp = _fsdp_key(key)
    entry = fsdp[1] if fsdp else KEYS[key]
    if entry.alias and (entry.alias_if is None or entry.alias_if(value)):
        yield Answer("alias", key, value, f"config: {key} is verl's FSDP name; {entry.note}", entry.alias)
    elif entry.accepts(value):
        if in_schema:
            yield Answer("accept", key, value)
        else:
            note = entry.same_note or entry.note
            yield Answer("note", key, value, f"config: {key}={value!r} is verl's; {note}: ignored"
                         if note else "")
    else:
        yield Answer("refuse", key, value, f"{key}={value!r}: {entry.fix}")
