"""Every key acts at its own full dotted path. The leaf-name scan of test_config_keys.py cannot
tell `actor_rollout_ref.actor.megatron.grad_offload` (read) from
`actor_rollout_ref.ref.megatron.grad_offload` (the same field of another section, ignored), so
for the sections whose class appears at several paths (MegatronConfig x 4, ModelConfig x 3,
OptimConfig x 2), and for every leaf whose name another section also has, reads are recorded
on the config objects themselves, each knowing its dotted path, during a real build, PPO step
and validation on 2 ranks (every model: actor, reference, critic and reward model, each from
its own HF directory). Each key must be read there, refused by
validation (a ConfigError naming it, tested below), or read only under a condition listed in
CONDITIONAL with the test that drives it."""
import dataclasses
import os
import sys

import pytest

from engine.config import ConfigError, load_config
from engine.config.load import field_types
from engine.config.schema import TridentConfig
from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
# checks and loading only look at a value; they do not make it act
NOT_READERS = tuple(os.path.join(ROOT, "engine", "config", f) for f in
                    ("schema.py", "load.py", "validate.py", "validate_experience.py", "checks.py"))
KEY = "_trident_key"
# walks over every field (asdict for the logged config, copies, dataclass-generated __eq__ /
# __repr__, whose code is "<string>") read all keys alike: no key acts through them
GENERIC = ("/dataclasses.py", "/copy.py", "/copyreg.py", "<string>")

REF, RM, CRITIC, ACTOR = ("actor_rollout_ref.ref.megatron", "reward_model.megatron", "critic.megatron",
                          "actor_rollout_ref.actor.megatron")
# key -> (a value that cannot act, words of the refusal)
REFUSED = {
    **{f"{s}.{k}": (v, "the model is frozen") for s in (REF, RM) for k, v in (
        ("grad_offload", True), ("optimizer_offload", True), ("overlap_grad_reduce", True),
        ("overlap_param_gather", True), ("use_distributed_optimizer", False),
        ("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 2))},
    **{f"{s}.tp_comm_overlap": (True, "TransformerEngine userbuffers") for s in (REF, RM, CRITIC, ACTOR)},
    **{f"{s}.seed": (7, "set actor_rollout_ref.actor.megatron.seed instead") for s in (REF, RM, CRITIC)},
    "critic.model.use_fused_kernels": (False, "the critic computes values"),
    "reward_model.model.use_fused_kernels": (False, "computes no log-probs"),
    **{f"{s}.lora_alpha": (8.0, "LoRA is implemented for the actor only")
       for s in ("critic.model", "reward_model.model")},
    **{f"{s}.target_modules": (["q_proj"], "LoRA is implemented for the actor only")
       for s in ("critic.model", "reward_model.model")},
    **{f"{s}.lora_rank": (4, "LoRA is implemented for the actor only") for s in ("critic.model", "reward_model.model")},
    "reward_model.model.config": ({"model_type": "llama"}, "loaded from reward_model.model.path"),
    "algorithm.kl_guard.enable": (True, "there is no KL term"),
    f"{RM}.reshard_after_forward": (False, "the reward model runs on Megatron-core's layout"),
    f"{RM}.forward_prefetch": (True, "the reward model runs on Megatron-core's layout"),
}
# read only when another key turns its feature on (the run here leaves it off) -> the test that drives it
CONDITIONAL = {
    "actor_rollout_ref.model.lora_alpha": "lora_rank > 0: tests/test_lora.py",
    "actor_rollout_ref.model.target_modules": "lora_rank > 0: tests/test_lora.py",
    **{f"{s}.{k}": "recompute_granularity set: engine/workers/base.py" for s in (ACTOR, CRITIC)
       for k in ("recompute_method", "recompute_num_layers")},
    "custom_reward_function.name": "custom_reward_function.path set: engine/train.py",
    "trainer.seed": "the entry point (engine/train.py), checkpoints and resume: tests/test_resume_rng.py",
    **{f"{s}.{k}": "strategy fsdp / fsdp2: tests/test_fsdp.py (refused under megatron there too)"
       for s in (ACTOR, CRITIC, REF) for k in ("reshard_after_forward", "forward_prefetch")},
}
# the refusals that need another key set to be reached
CONTEXT = {"algorithm.kl_guard.enable": ["actor_rollout_ref.actor.use_kl_loss=false"],
           "reward_model.model.use_fused_kernels": ["reward_model.enable=false"]}


def _sections(cls=TridentConfig, prefix=""):
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            key = f"{prefix}.{name}" if prefix else name
            yield key, tp
            yield from _sections(tp, key)


def shared_paths():
    """{dotted section path: class} for the classes that appear at more than one path."""
    by_class = {}
    for key, cls in _sections():
        by_class.setdefault(cls, []).append(key)
    return {k: cls for cls, keys in by_class.items() if len(keys) > 1 for k in keys}


def _tag(obj, path):
    object.__setattr__(obj, KEY, path)
    for f in dataclasses.fields(obj):
        value = object.__getattribute__(obj, f.name)
        if dataclasses.is_dataclass(value):
            _tag(value, f"{path}.{f.name}" if path else f.name)


def _install(reads):
    """Record `path.field` whenever code outside the checks reads a field of a tagged section."""
    classes = {cls for _, cls in _sections()} | {TridentConfig}
    get = object.__getattribute__
    fields = {cls: set(cls.__dataclass_fields__) for cls in classes}

    def getattribute(self, name):
        value = get(self, name)
        if name in fields[type(self)]:
            path = get(self, "__dict__").get(KEY)
            caller = sys._getframe(1).f_code.co_filename
            if path is not None and caller not in NOT_READERS and caller != __file__ \
                    and not caller.endswith(GENERIC):
                reads.add(f"{path}.{name}" if path else name)
        return value
    for cls in classes:
        cls.__getattribute__ = getattribute
    return lambda: [delattr(cls, "__getattribute__") for cls in classes]


def _models(tmp):
    import torch
    import transformers

    from engine.tasks import save_tokenizer
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=20, max_position_embeddings=64, tie_word_embeddings=False,
               num_labels=1, pad_token_id=None)
    value = transformers.LlamaForSequenceClassification
    for name, cls in (("policy", transformers.LlamaForCausalLM), ("critic", value), ("rm", value)):
        torch.manual_seed(len(name))
        cls(transformers.LlamaConfig(**cfg)).save_pretrained(f"{tmp}/{name}")
        save_tokenizer(f"{tmp}/{name}")


def _reads_of_a_step(tmp):
    import torch.distributed as dist

    from engine.train import build
    from engine.trainer import Trainer, set_seed
    if dist.get_rank() == 0:
        _models(tmp)
    dist.barrier()
    cfg = load_config(DEMO, [
        "actor_rollout_ref.model.config=null", f"actor_rollout_ref.model.path={tmp}/policy",
        f"critic.model.path={tmp}/critic", f"reward_model.model.path={tmp}/rm", "reward_model.enable=true",
        "reward_model.micro_batch_size_per_gpu=8", "algorithm.adv_estimator=gae", "data.train_batch_size=8",
        "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=48",  # the actor's split by count
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.test_freq=-1", "trainer.logger=[]",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp}/ck",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}"])
    reads = set()
    uninstall = _install(reads)
    try:
        _tag(cfg, "")
        set_seed(cfg.trainer.seed)
        t = Trainer(*build(cfg, 2))
        t.train_step(t.loader.next_batch())
        t.validate()
    finally:
        uninstall()
    return sorted(reads)


@pytest.fixture(scope="module")
def step_reads(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    return set().union(*map(set, run_on_ranks(_reads_of_a_step, 2, str(tmp))))


def ambiguous_keys():
    """The keys a leaf-name scan cannot tell apart: every leaf of a section whose class appears
    at several paths, and every leaf whose name another section also has (enable, n, seed ...)."""
    from collections import Counter

    from tests.test_config_keys import config_leaves
    leaves = list(config_leaves())
    names = Counter(k.rsplit(".", 1)[1] for k in leaves)
    shared = shared_paths()
    return [k for k in leaves if k.rsplit(".", 1)[0] in shared or names[k.rsplit(".", 1)[1]] > 1]


def test_every_ambiguous_key_acts_at_its_own_path(step_reads):
    assert any(k.startswith(REF) for k in step_reads)  # the recording sees every section
    keys = ambiguous_keys()
    assert "actor_rollout_ref.ref.megatron.grad_offload" in keys and "algorithm.replay.enable" in keys
    unread = [k for k in keys if k not in step_reads and k not in REFUSED and k not in CONDITIONAL]
    assert unread == []


def test_the_tables_name_real_keys(step_reads):
    from engine.config import all_keys
    assert set(REFUSED) | set(CONDITIONAL) <= set(all_keys())
    # a conditional key read in the plain step belongs nowhere in the table
    assert sorted(k for k in CONDITIONAL if k in step_reads) == []


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_keys_that_cannot_act_are_refused(key):
    value, words = REFUSED[key]
    text = str(value).lower() if isinstance(value, bool) else value
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [*CONTEXT.get(key, []), f"{key}={text}"])
    message = str(info.value)
    assert message.startswith(f"{key}=") and words in message and "\n" not in message
