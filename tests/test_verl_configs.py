"""A recipe brought from verl (tests/verl_configs/): every verl key Trident does not act on gets one
line naming the key and what to use instead, all of them in one message (no traceback, no list
of a section's keys); with those keys changed the recipe validates, derives and plans. The keys
Trident reads under its own name are noted once each in the log."""
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

STRATEGY = ("Trident trains with Megatron-core (FSDP on Megatron-core is planned, not here yet); set it to "
            "megatron: {m}.use_distributed_optimizer: true (the default) shards the optimizer state over DP "
            "and {m}.tensor_model_parallel_size the parameters")
# The recipe as it comes: the lines of its one message, in the file's order.
REFUSED = [
    f"{A}.strategy='fsdp2': " + STRATEGY.format(m=M),
    f"{A}.fsdp_config.offload_policy=True: FSDP2's CPU offload policy (the optimizer step run on the CPU) "
    f"has no Megatron-core counterpart here; remove it: {M}.param_offload, grad_offload and "
    "optimizer_offload move each state to the host while the model is idle",
    f"{R}.enforce_eager=True: the rollout engine's CUDA graphs cannot be turned off from a recipe yet; "
    f"remove it (or set {R}.name=hf: transformers, no CUDA graphs)",
    "critic.strategy='fsdp2': " + STRATEGY.format(m="critic.megatron"),
]
# rollout.name=vllm is the vLLM backend's to answer (engine/rollout/vllm.py); until it is
# registered the value is refused, one line, between the actor's lines and the critic's.
VLLM_REFUSED = f"{R}.name='vllm' is not allowed: use one of "
FIXES = [f"{A}.strategy=megatron", "critic.strategy=megatron", f"{A}.fsdp_config.offload_policy=false",
         f"{R}.enforce_eager=false", f"{R}.name=cpu", "trainer.n_gpus_per_node=2"]
# With FIXES: one note per verl key read as Trident's or ignored (the file's order, then the overrides').
NOTES = [
    f"config: {A}.fsdp_config.param_offload is verl's FSDP name; read as {M}.param_offload and grad_offload "
    "(Megatron keeps a gradient buffer that FSDP frees after each step)",
    f"config: {A}.fsdp_config.optimizer_offload is verl's FSDP name; read as {M}.optimizer_offload",
    f"config: {A}.fsdp_config.reshard_after_forward=True is verl's; Megatron-core never gathers whole "
    "parameters (each rank keeps its TP/PP shard), so there is nothing to reshard: ignored",
    f"config: {A}.fsdp_config.forward_prefetch=False is verl's; no FSDP all-gather to prefetch, as false "
    "asks: ignored",
    f"config: {A}.fsdp_config.fsdp_size=-1 is verl's; Megatron-core's distributed optimizer shards over all "
    "DP ranks, as -1 asks: ignored",
    f"config: {A}.fsdp_config.wrap_policy={{'min_num_params': 0}} is verl's; FSDP's wrapping units; "
    "Megatron-core builds its own layers: ignored",
    f"config: {R}.enable_chunked_prefill=True is verl's; the GPU rollout (SGLang) prefills in chunks of "
    f"{R}.max_num_batched_tokens, as true asks: ignored",
    f"config: {R}.load_format='dummy_dtensor' is verl's; the rollout engine starts without the checkpoint "
    "and receives the actor's weights before it generates, as dummy* asks: ignored",
    "config: actor_rollout_ref.ref.fsdp_config.param_offload is verl's FSDP name; read as "
    "actor_rollout_ref.ref.megatron.param_offload",
    "config: critic.model.fsdp_config.param_offload is verl's FSDP name; read as critic.megatron.param_offload "
    "and grad_offload (Megatron keeps a gradient buffer that FSDP frees after each step)",
    "config: critic.model.fsdp_config.optimizer_offload is verl's FSDP name; read as "
    "critic.megatron.optimizer_offload",
    "config: trainer.critic_warmup=0 is verl's; the actor trains from the first step, as 0 asks: ignored",
    f"config: {A}.fsdp_config.offload_policy=False is verl's; FSDP2's CPU offload policy off, as here: ignored",
    f"config: {R}.enforce_eager=False is verl's; the GPU rollout (SGLang) captures CUDA graphs, as vLLM "
    "does with false: ignored",
]


def _cli(*args, tool=("-m", "engine.train")):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)  # never a GPU run, whatever the machine
    env.pop("RANK", None)
    return subprocess.run([sys.executable, *tool, RECIPE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _without_vllm(lines):
    """The lines but the vLLM backend's (present only while 'vllm' is not a registered backend)."""
    vllm = [x for x in lines if x.startswith(VLLM_REFUSED)]
    assert len(vllm) <= 1
    return [x for x in lines if x not in vllm]


def test_the_recipe_as_verl_takes_it_is_one_message_one_line_per_key():
    proc = _cli()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    errors = [x for x in lines if x.startswith("error")]
    assert errors == [lines[0]]  # one message, first on stderr
    body = [x[2:] for x in lines[1:]]
    assert all(x.startswith("  ") for x in lines[1:])
    assert _without_vllm(body) == REFUSED
    assert lines[0] == f"error: {len(body)} keys of this recipe need changing, one per line:"
    assert "valid keys" not in proc.stderr and "config: " not in proc.stderr  # no section lists, no notes


def test_load_config_gives_the_lines():
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE)
    assert _without_vllm(info.value.lines) == REFUSED


def test_the_message_is_printed_once_per_rank_with_its_lines(monkeypatch, capsys):
    monkeypatch.setattr("engine.errors.PEER_GRACE_S", 0.0)
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE)
    assert report(info.value, rank=1) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error (rank 1): ") and err[0].endswith("keys of this recipe need changing, one per line:")
    assert _without_vllm([x[2:] for x in err[1:]]) == REFUSED


def test_changed_as_the_lines_say_it_validates_derives_and_plans(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.config.load"):
        cfg = load_config(RECIPE, FIXES)
    assert [r.getMessage() for r in caplog.records if r.name == "engine.config.load"] == NOTES
    for section in (cfg.actor_rollout_ref.actor.megatron, cfg.critic.megatron):  # fsdp_config's offloads
        assert (section.param_offload, section.grad_offload, section.optimizer_offload) == (True, True, True)
    assert cfg.actor_rollout_ref.ref.megatron.param_offload is True
    assert cfg.actor_rollout_ref.ref.megatron.grad_offload is False  # frozen: no gradients
    d = derive(cfg, world_size=2)
    assert d.layout.dp == 2 and d.config.trainer.device == "cpu"
    assert d.config.actor_rollout_ref.rollout.max_num_seqs == 512
    proc = _cli(*FIXES, tool=(os.path.join(ROOT, "tools", "plan.py"),))
    assert proc.returncode == 0, proc.stderr
    assert "-> fits" in proc.stdout and "DP=2" in proc.stdout


def test_vllm_is_the_one_line_left():
    """rollout.name=vllm with the rest changed: one line on the rollout name (no GPU here)."""
    proc = _cli(*[f for f in FIXES if not f.startswith((f"{R}.name=", "trainer.n_gpus_per_node="))],
                "trainer.n_gpus_per_node=1")  # one process
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    assert len(lines) == 1 and lines[0].startswith(f"error: {R}.name='vllm'"), proc.stderr  # no notes either


@pytest.mark.parametrize("override, line", [
    (f"{A}.fsdp_config.fsdp_size=4", f"{A}.fsdp_config.fsdp_size=4: FSDP's shard-group size (HSDP); "
     f"Megatron-core shards the parameters over {M}.tensor_model_parallel_size and the optimizer state over "
     "all DP ranks; remove it"),
    (f"{A}.fsdp_config.forward_prefetch=true", f"{A}.fsdp_config.forward_prefetch=True: FSDP's all-gather "
     f"prefetch; use {M}.overlap_param_gather: true (the distributed optimizer's parameter all-gather "
     "overlapped with the forward)"),
    ("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true", "actor_rollout_ref.ref.fsdp_config."
     "optimizer_offload=True: the model is frozen (no gradients, no optimizer); remove it "
     "(actor_rollout_ref.ref.megatron.param_offload offloads its weights)"),
    ("critic.model.fsdp_config.model_dtype=bf16", "critic.model.fsdp_config.model_dtype='bf16': an FSDP "
     "setting of verl's; Trident trains with Megatron-core (this model's settings are critic.megatron.*); "
     "remove it"),
    (f"{R}.enable_chunked_prefill=false", f"{R}.enable_chunked_prefill=False: the rollout always prefills "
     f"in chunks of {R}.max_num_batched_tokens; remove it (a max_num_batched_tokens >= prompt_length + "
     "response_length prefills each prompt whole)"),
    (f"{R}.load_format=hf", f"{R}.load_format='hf': the rollout engine always starts with dummy weights and "
     "receives the actor's before it generates (nothing is loaded from disk); remove it"),
    (f"{R}.max_model_len=4096", f"{R}.max_model_len=4096: each engine's context is {R}.prompt_length + "
     "response_length (data.max_prompt_length + max_response_length by default); remove it and set those"),
    ("trainer.critic_warmup=3", "trainer.critic_warmup=3: no critic-only warm-up steps yet: the actor "
     "trains from the first step; remove it (or start from a critic trained beforehand: critic.model.path)"),
    (f"{A}.ulysses_sequence_parallel_size=2", f"{A}.ulysses_sequence_parallel_size=2: Ulysses sequence "
     f"parallelism is FSDP's; Megatron-core splits long sequences over {M}.context_parallel_size (and "
     "sequence_parallel with TP); remove it"),
    ("actor_rollout_ref.ref.strategy=fsdp", "actor_rollout_ref.ref.strategy='fsdp': Trident trains with "
     "Megatron-core (FSDP on Megatron-core is planned, not here yet); set it to megatron: this frozen model "
     "takes the actor's layout (actor_rollout_ref.actor.megatron)"),
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
    cfg = load_config(DEMO, [f"{A}.strategy=fsdp", f"{A}.strategy=megatron",
                             f"{A}.fsdp_config.fsdp_size=4", f"{A}.fsdp_config={{fsdp_size: -1}}"])
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"


def test_only_the_strategy_is_both_a_trident_key_and_in_the_verl_table():
    """A verl key Trident's schema gains (e.g. rollout.enforce_eager once the vLLM backend reads it)
    must leave engine/config/verl.py's table, or its refusal would shadow the new key."""
    assert set(verl.KEYS) & set(all_keys()) == {f"{A}.strategy"}
