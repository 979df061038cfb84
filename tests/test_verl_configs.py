"""A recipe brought from verl (tests/verl_configs/: FSDP2 + vLLM) loads unchanged: the keys Trident
reads under its own name, or meets by what it does, are noted once each in the log; on this CPU
machine the one line left is the vLLM backend's need for a GPU, and with the CPU backend it
derives and plans (it trains: tests/test_fsdp.py). A verl key at a value Trident does not act on
gets one line naming the key and what to use instead, all of a recipe's in one message (no
traceback, no list of a section's keys)."""
import logging
import os
import subprocess
import sys

import pytest

from engine.config import ConfigError, all_keys, derive, load_config
from engine.config import verl
from engine.errors import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "tests", "verl_configs", "qwen2_5_7b_gsm8k_fsdp2.yaml")
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
A, R, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.actor.megatron"

P = "critic.megatron"
# The recipe as verl takes it loads unchanged: one note per verl key read as Trident's or met by
# what Trident does (the file's order); nothing refused.
NOTES = [
    f"config: {A}.fsdp_config.param_offload is verl's FSDP name; read as {M}.param_offload and grad_offload "
    "(Megatron keeps a gradient buffer that FSDP frees after each step)",
    f"config: {A}.fsdp_config.optimizer_offload is verl's FSDP name; read as {M}.optimizer_offload",
    f"config: {A}.fsdp_config.offload_policy is verl's FSDP name; FSDP2's CPU offload policy read as "
    f"{M}.param_offload, {M}.grad_offload, {M}.optimizer_offload: the states wait on the host while the "
    "model is idle and come back for its phase (the optimizer step runs on the device, not on the CPU as "
    "FSDP2's policy runs it)",
    f"config: {A}.fsdp_config.reshard_after_forward is verl's FSDP name; read as {M}.reshard_after_forward "
    "(read under strategy fsdp / fsdp2; with megatron, validation refuses a non-default value)",
    f"config: {A}.fsdp_config.forward_prefetch is verl's FSDP name; read as {M}.forward_prefetch "
    "(read under strategy fsdp / fsdp2; with megatron, validation refuses a non-default value)",
    f"config: {A}.fsdp_config.fsdp_size=-1 is verl's; strategy fsdp / fsdp2 shard over all data-parallel "
    "ranks, as -1 asks: ignored",
    f"config: {A}.fsdp_config.wrap_policy={{'min_num_params': 0}} is verl's; the fully sharded strategies "
    "wrap each transformer layer, the embedding and RoPE (Megatron-core's units); the rest is the root "
    "unit: ignored",
    f"config: {R}.load_format='dummy_dtensor' is verl's; the rollout engine starts without the checkpoint "
    "and receives the actor's weights before it generates, as dummy* asks: ignored",
    "config: actor_rollout_ref.ref.fsdp_config.param_offload is verl's FSDP name; read as "
    "actor_rollout_ref.ref.megatron.param_offload",
    f"config: critic.model.fsdp_config.param_offload is verl's FSDP name; read as {P}.param_offload "
    "and grad_offload (Megatron keeps a gradient buffer that FSDP frees after each step)",
    f"config: critic.model.fsdp_config.optimizer_offload is verl's FSDP name; read as {P}.optimizer_offload",
    "config: trainer.critic_warmup=0 is verl's; the actor trains from the first step, as 0 asks: ignored",
]
# What this CPU machine changes: the rollout backend and the number of processes
CPU = [f"{R}.name=cpu", "trainer.n_gpus_per_node=2"]
# Keys verl accepts at values Trident does not act on: all of a recipe's in one message
REFUSED_OVERRIDES = ["reward_model.strategy=fsdp2", f"{A}.fsdp_config.fsdp_size=4",
                     "critic.model.fsdp_config.model_dtype=bf16"]
REFUSED = [
    "reward_model.strategy='fsdp2': the reward model scores with Megatron-core's layout "
    "(reward_model.megatron.*; it shares the actor's parallel sizes); remove it or set megatron",
    f"{A}.fsdp_config.fsdp_size=4: sharding over groups smaller than data parallel (HSDP) is not here: the "
    "fully sharded strategies shard over all DP ranks; set -1 (or remove it)",
    "critic.model.fsdp_config.model_dtype='bf16': an FSDP setting of verl's that Trident does not act on "
    "(the fully sharded strategies read param_offload, optimizer_offload, offload_policy, "
    "reshard_after_forward, forward_prefetch, fsdp_size, wrap_policy; this model's settings are "
    "critic.megatron.*); remove it",
]


def _cli(*args, tool=("-m", "engine.train")):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)  # never a GPU run, whatever the machine
    env.pop("RANK", None)
    return subprocess.run([sys.executable, *tool, RECIPE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _lines(stderr):
    return [x for x in stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]


def test_the_recipe_loads_as_verl_wrote_it_with_one_note_per_verl_key(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.config.load"):
        cfg = load_config(RECIPE)
    assert [r.getMessage() for r in caplog.records if r.name == "engine.config.load"] == NOTES
    arr = cfg.actor_rollout_ref
    assert (arr.actor.strategy, cfg.critic.strategy, arr.ref.strategy) == ("fsdp2", "fsdp2", None)
    for section in (arr.actor.megatron, cfg.critic.megatron):  # fsdp_config's offloads, offload_policy
        assert (section.param_offload, section.grad_offload, section.optimizer_offload) == (True, True, True)
    assert arr.ref.megatron.param_offload is True and arr.ref.megatron.grad_offload is False  # frozen
    assert (arr.actor.megatron.reshard_after_forward, arr.actor.megatron.forward_prefetch) == (True, False)
    r = arr.rollout
    assert (r.name, r.enforce_eager, r.enable_chunked_prefill, r.gpu_memory_utilization) == ("vllm", True, True, 0.6)
    d = derive(load_config(RECIPE, CPU), world_size=2)
    assert d.layout.dp == 2 and d.config.trainer.device == "cpu"
    assert d.config.critic.strategy == d.config.actor_rollout_ref.ref.strategy == "fsdp2"  # the actor's


def test_on_a_machine_without_a_gpu_the_one_line_is_the_vllm_backends():
    proc = _cli("trainer.n_gpus_per_node=1")  # one process
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {R}.name='vllm': this backend needs a GPU"), proc.stderr


def test_with_this_machines_backend_it_plans():
    proc = _cli(*CPU, tool=(os.path.join(ROOT, "tools", "plan.py"),))
    assert proc.returncode == 0, proc.stderr
    assert "-> fits" in proc.stdout and "DP=2" in proc.stdout


def test_enforce_eager_and_chunked_prefill_reach_both_gpu_engines():
    """verl's vLLM switches are rollout keys every GPU backend reads (the engines' own arguments)."""
    from engine.rollout.sglang import engine_kwargs
    from engine.rollout.vllm import llm_kwargs
    r = load_config(RECIPE, [f"{R}.enable_chunked_prefill=false", f"{R}.max_num_batched_tokens=64"]
                    ).actor_rollout_ref.rollout
    sglang = engine_kwargs("m", "bfloat16", "dummy", 1, 0.6, r.max_num_batched_tokens, 0, False, False,
                           enforce_eager=r.enforce_eager, enable_chunked_prefill=r.enable_chunked_prefill)
    assert (sglang["disable_cuda_graph"], sglang["chunked_prefill_size"]) == (True, -1)
    vllm = llm_kwargs("m", max_num_batched_tokens=r.max_num_batched_tokens, enforce_eager=r.enforce_eager,
                      enable_chunked_prefill=r.enable_chunked_prefill)
    assert (vllm["enforce_eager"], vllm["enable_chunked_prefill"]) == (True, False)
    default = engine_kwargs("m", "bfloat16", "dummy", 1, 0.6, 64, 0, False, False)
    assert (default["disable_cuda_graph"], default["chunked_prefill_size"]) == (False, 64)


def test_refused_keys_are_one_message_one_line_per_key():
    proc = _cli(*REFUSED_OVERRIDES)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = _lines(proc.stderr)
    assert [x for x in lines if x.startswith("error")] == [lines[0]]  # one message, first on stderr
    assert all(x.startswith("  ") for x in lines[1:])
    assert [x[2:] for x in lines[1:]] == REFUSED
    assert lines[0] == f"error: {len(REFUSED)} keys of this recipe need changing, one per line:"
    assert "valid keys" not in proc.stderr and "config: " not in proc.stderr  # no section lists, no notes


def test_load_config_gives_the_lines():
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, REFUSED_OVERRIDES)
    assert info.value.lines == REFUSED


def test_the_message_is_printed_once_per_rank_with_its_lines(monkeypatch, capsys):
    monkeypatch.setattr("engine.errors.PEER_GRACE_S", 0.0)
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, REFUSED_OVERRIDES)
    assert report(info.value, rank=1) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error (rank 1): ") and err[0].endswith("keys of this recipe need changing, one per line:")
    assert [x[2:] for x in err[1:]] == REFUSED


@pytest.mark.parametrize("override, line", [
    (f"{A}.fsdp_config.fsdp_size=4", f"{A}.fsdp_config.fsdp_size=4: sharding over groups smaller than data "
     "parallel (HSDP) is not here: the fully sharded strategies shard over all DP ranks; set -1 (or remove it)"),
    (f"{A}.fsdp_config.offload_policy=maybe", f"{A}.fsdp_config.offload_policy='maybe': expected true or false"),
    ("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true", "actor_rollout_ref.ref.fsdp_config."
     "optimizer_offload=True: the model is frozen (no gradients, no optimizer); remove it "
     "(actor_rollout_ref.ref.megatron.param_offload offloads its weights)"),
    ("critic.model.fsdp_config.model_dtype=bf16", REFUSED[2]),
    (f"{R}.load_format=hf", f"{R}.load_format='hf': the rollout engine always starts with dummy weights and "
     "receives the actor's before it generates (nothing is loaded from disk); remove it"),
    (f"{R}.max_model_len=4096", f"{R}.max_model_len=4096: each engine's context is {R}.prompt_length + "
     "response_length (data.max_prompt_length + max_response_length by default); remove it and set those"),
    ("trainer.critic_warmup=3", "trainer.critic_warmup=3: no critic-only warm-up steps yet: the actor "
     "trains from the first step; remove it (or start from a critic trained beforehand: critic.model.path)"),
    (f"{A}.ulysses_sequence_parallel_size=2", f"{A}.ulysses_sequence_parallel_size=2: Ulysses sequence "
     f"parallelism is FSDP's; Megatron-core splits long sequences over {M}.context_parallel_size (and "
     "sequence_parallel with TP); remove it"),
    ("reward_model.strategy=fsdp", "reward_model.strategy='fsdp': the reward model scores with Megatron-core's "
     "layout (reward_model.megatron.*; it shares the actor's parallel sizes); remove it or set megatron"),
    (f"{A}.fsdp_config=3", f"{A}.fsdp_config=3: expected a mapping of verl's FSDP keys; remove it (Trident "
     "trains with Megatron-core)"),
    ("data.zzz=1", "unknown config key 'data.zzz': no key of that name in 'data' nor elsewhere; remove it "
     "(the keys: DataConfig in engine/config/schema.py)"),
])
def test_each_refused_key_is_one_line(override, line):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [override])
    assert str(info.value) == line and not hasattr(info.value, "lines")


def test_a_later_override_takes_the_key_back():
    """The file's refused value, then an override the key takes: no line left for it."""
    cfg = load_config(DEMO, ["reward_model.strategy=fsdp", "reward_model.strategy=megatron",
                             f"{A}.fsdp_config.fsdp_size=4", f"{A}.fsdp_config={{fsdp_size: -1}}"])
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"


def test_no_key_is_both_a_trident_key_and_in_the_verl_table():
    """A verl key Trident's schema gains (as strategy, rollout.enforce_eager and
    enable_chunked_prefill did) must leave engine/config/verl.py's table, or its refusal would
    shadow the new key."""
    assert set(verl.KEYS) & set(all_keys()) == set()


def test_a_roles_profiler_section_is_noted_off_and_refused_on(caplog):
    """verl's per-role `profiler` sections (in every dumped ppo_trainer config): off, one note per
    section; switched on, one line naming global_profiler, which profiles whole steps here."""
    off = "{enable: false, all_ranks: false, ranks: [], tool_config: {torch: {contents: [cpu]}}}"
    with caplog.at_level(logging.WARNING, logger="engine.config.load"):
        load_config(DEMO, [f"{A}.profiler={off}", "critic.profiler.ranks=[0]"])
    notes = [r.getMessage() for r in caplog.records if r.name == "engine.config.load"]
    assert notes == [f"config: {A}.profiler is verl's per-role profiler, off here: ignored (global_profiler.* "
                     "profiles whole steps)", "config: critic.profiler.ranks is verl's per-role profiler, off "
                     "here: ignored (global_profiler.* profiles whole steps)"]
    for override in (f"{R}.profiler.enable=true", f"{A}.profiler={{enable: true, ranks: [0]}}"):
        with pytest.raises(ConfigError) as info:
            load_config(DEMO, [override])
        line = str(info.value)
        assert line.startswith(override.split("=")[0]) and "global_profiler.tool=torch" in line, line
