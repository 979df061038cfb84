"""Typed recipe schema: dataclasses loaded from YAML plus dotted CLI overrides, then validated.

    cfg = load_config("recipes/tiny_cpu_demo.yaml", ["actor_rollout_ref.actor.kl_loss_coef=0.002"])
    d = derive(cfg, world_size=2, dataset_len=1024)   # layout checks + every derived number
    d.config.actor_rollout_ref.rollout.response_length, d.layout.dp, d.actor.grad_accum_steps

Keys follow verl's names. A few keys are `null` = "auto" and are filled in by `derive()` only
(the one place where derived values are computed); after `derive`, read `d.config`:

- rollout.prompt_length / response_length      -> data.max_prompt_length / max_response_length
- rollout.* and ref.* log_prob_* batch keys     -> the actor's ppo_* batch keys
- critic.enable                                 -> algorithm.adv_estimator == 'gae'
- critic.ppo_mini_batch_size / micro / epochs   -> the actor's
- critic.model.path / config / tokenizer_path   -> the actor's model (when both path and config are null)
- actor.clip_ratio_low / clip_ratio_high        -> actor.clip_ratio
- megatron.expert_tensor_parallel_size          -> tensor_model_parallel_size (as in Megatron)
- ref/critic/reward_model megatron layout keys  -> the actor's (one process-group layout per run)
- optim.total_training_steps, optim.lr_warmup_steps=-1, trainer.total_training_steps,
  trainer.default_local_dir / log_dir, trainer.device='auto', rollout.name='auto'

Every problem raises `ConfigError` (a ValueError) naming the dotted key, the value and the fix.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A recipe problem: names the dotted key, the offending value and how to fix it."""


# --------------------------------------------------------------------------------------------
# Allowed values
# --------------------------------------------------------------------------------------------

Truncation = Literal["error", "left", "right", "filter"]
PolicyLoss = Literal["vanilla", "gspo"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# "+" variants: the value of the named estimator with the gradient of k2 (straight-through).
KlEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+", "full+"]
LrDecayStyle = Literal["constant", "linear", "cosine"]
ParamsDtype = Literal["float32", "bfloat16", "float16"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
CheckpointContent = Literal["model", "optimizer", "extra"]
RolloutName = Literal["cpu", "sglang", "auto"]
RewardManager = Literal["naive", "batch"]
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
KlCtrlType = Literal["fixed", "adaptive"]
Logger = Literal["console", "tensorboard", "jsonl", "wandb", "swanlab", "mlflow"]
Device = Literal["auto", "cpu", "cuda"]
ResumeMode = Literal["auto", "disable", "resume_path"]

# Estimators that compare responses within a group of n samples per prompt.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
# Keys that share one Megatron process-group layout across all models of a run.
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")

# verl keys that live elsewhere here (one key per concept): unknown-key errors point at them.
MOVED_KEYS = {
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
    "critic.grad_clip": "critic.optim.clip_grad",
    "actor_rollout_ref.ref.param_offload": "actor_rollout_ref.ref.megatron.param_offload",
    "actor_rollout_ref.actor.clip_grad": "actor_rollout_ref.actor.optim.clip_grad",
}


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------

@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet file(s); a lone string is accepted
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per PPO step
    val_batch_size: Optional[int] = None  # null: the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    truncation: Truncation = "error"  # over-long prompts: raise, cut left/right, or drop them
    filter_overlong_prompts: bool = False  # same as truncation='filter' (derive() makes both agree)
    return_raw_chat: bool = False
    chat_template: bool = True  # format prompts with the tokenizer's chat template
    builtin_task: Optional[str] = None  # built-in synthetic task (engine/tasks.py) instead of files
    builtin_task_difficulty: int = 0  # engine/tasks.py difficulty levels (0 = easiest)
    dataloader_num_workers: int = 0


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model directory
    tokenizer_path: Optional[str] = None  # null: the model path (or the built-in task's tokenizer)
    config: Optional[dict] = None  # inline HF config dict: builds a randomly initialised model
    use_fused_kernels: bool = True
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    override_config: dict = field(default_factory=dict)  # merged into the pretrained model's config


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    min_lr: float = 0.0
    lr_decay_style: LrDecayStyle = "constant"
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    total_training_steps: Optional[int] = None  # filled by derive(); leave null


@dataclass
class MegatronConfig:
    # Layout keys. In ref/critic/reward_model sections null means "same as the actor".
    tensor_model_parallel_size: Optional[int] = 1
    pipeline_model_parallel_size: Optional[int] = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None  # null: no interleaving
    context_parallel_size: Optional[int] = 1
    expert_model_parallel_size: Optional[int] = 1
    expert_tensor_parallel_size: Optional[int] = None  # null: same as tensor_model_parallel_size
    sequence_parallel: Optional[bool] = False
    # Per-model settings.
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    recompute_granularity: Optional[RecomputeGranularity] = None
    recompute_method: Optional[RecomputeMethod] = None
    recompute_num_layers: Optional[int] = None
    seed: int = 42
    params_dtype: Optional[ParamsDtype] = "bfloat16"  # ref / critic / reward model: null = the actor's


def _inherited_megatron() -> MegatronConfig:
    return MegatronConfig(tensor_model_parallel_size=None, pipeline_model_parallel_size=None,
                          context_parallel_size=None, expert_model_parallel_size=None,
                          sequence_parallel=None, params_dtype=None)


@dataclass
class CheckpointConfig:
    save_contents: list[CheckpointContent] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class ActorConfig:
    strategy: Literal["megatron"] = "megatron"
    ppo_mini_batch_size: int = 256  # prompts per mini-batch (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # sequences; required unless use_dynamic_bsz
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # null: clip_ratio
    clip_ratio_high: Optional[float] = None  # null: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    policy_loss: PolicyLoss = "vanilla"
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KlEstimator = "low_var_kl"
    router_replay: bool = False  # MoE: replay the rollout's expert routing in training
    # On-policy steps (ppo_epochs 1, one mini-batch per step, no KL in the reward) take the old
    # log-probs from the update's own forward, detached, instead of a separate forward pass:
    # same weights, so the same values (ratio exactly 1), one forward fewer per step.
    on_policy_old_log_prob: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig:
    name: RolloutName = "auto"  # auto: sglang on cuda, cpu otherwise
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    n: int = 1  # responses per prompt
    prompt_length: Optional[int] = None  # null: data.max_prompt_length
    response_length: Optional[int] = None  # null: data.max_response_length
    do_sample: bool = True
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    free_cache_engine: bool = True
    update_weights_bucket_megabytes: int = 512
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # null: actor's ppo_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null: actor's use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null: actor's ppo_max_token_len_per_gpu
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # always generate response_length tokens (throughput benchmarks)
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=_inherited_megatron)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # null: true iff algorithm.adv_estimator == 'gae'
    model: ModelConfig = field(default_factory=ModelConfig)  # path and config null: the actor's model
    ppo_mini_batch_size: Optional[int] = None  # null: the actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # null: the actor's
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: Optional[int] = None  # null: the actor's
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=_inherited_megatron)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0  # tokens before max_response_length where the length penalty starts
    penalty_factor: float = 1.0


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # required when enabled
    megatron: MegatronConfig = field(default_factory=_inherited_megatron)
    reward_manager: RewardManager = "naive"
    num_workers: int = 0  # Ray pool size for rule rewards; 0: in process
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class KlCtrlConfig:
    type: KlCtrlType = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class KlGuardConfig:
    enable: bool = False
    kl_ceiling: float = 0.1
    entropy_floor: float = 0.0
    raise_factor: float = 2.0
    lower_factor: float = 0.5


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvEstimator = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KlEstimator = "kl"
    kl_ctrl: KlCtrlConfig = field(default_factory=KlCtrlConfig)
    kl_guard: KlGuardConfig = field(default_factory=KlGuardConfig)


@dataclass
class TrainerConfig:
    project_name: str = "trident"
    experiment_name: str = "default"
    logger: list[Logger] = field(default_factory=lambda: ["console"])
    nnodes: int = 1
    n_gpus_per_node: int = 8
    device: Device = "auto"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # null: epochs x (dataset prompts // train_batch_size)
    test_freq: int = -1  # -1: never
    save_freq: int = -1  # -1: never
    val_before_train: bool = True
    default_local_dir: Optional[str] = None  # null: checkpoints/{project_name}/{experiment_name}
    resume_mode: ResumeMode = "auto"
    resume_from_path: Optional[str] = None
    max_actor_ckpt_to_keep: Optional[int] = None  # null: keep all
    save_hf: bool = False
    log_dir: Optional[str] = None  # null: logs/{project_name}/{experiment_name}
    profile_comm: bool = False  # time spent blocked in collectives per phase (perf/comm_s/*)
    seed: int = 1


@dataclass
class TridentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# --------------------------------------------------------------------------------------------
# YAML (with YAML 1.2 floats: PyYAML alone reads `1e-3` as a string)
# --------------------------------------------------------------------------------------------

_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):  # the dumper needs it too, so it quotes strings like '1e-3'
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


# --------------------------------------------------------------------------------------------
# Loading: mappings and overrides onto typed dataclasses
# --------------------------------------------------------------------------------------------

def load_config(path: Optional[str] = None, overrides: typing.Sequence[str] = ()) -> TridentConfig:
    """Defaults <- YAML file (if any) <- `a.b.c=value` overrides, then `validate`."""
    cfg = TridentConfig()
    if path is not None:
        with open(path) as f:
            data = _parse_yaml(f.read(), str(path))
        if data is not None:
            _merge(cfg, data, "")
    for override in overrides:
        apply_override(cfg, override)
    validate(cfg)
    return cfg


def from_dict(data: dict) -> TridentConfig:
    """Build and validate a config from a nested mapping (missing keys take defaults)."""
    cfg = TridentConfig()
    _merge(cfg, data, "")
    validate(cfg)
    return cfg


def to_dict(cfg: TridentConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TridentConfig) -> str:
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def apply_override(cfg: TridentConfig, override: str) -> None:
    """Set one `dotted.key=value` in place; the value is parsed as YAML (1e-3, true, [1,2], null)."""
    key, sep, text = override.partition("=")
    key = key.strip().lstrip("+")  # verl/Hydra habit: `+key=value`; every key here is in the schema
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} must look like section.key=value, "
                          f"e.g. actor_rollout_ref.actor.kl_loss_coef=0.002")
    value = _parse_yaml(text, f"override {override!r}")
    _set_path(cfg, key.split("."), value, "")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _merge(obj: Any, data: Any, prefix: str) -> None:
    if data is None:  # an empty YAML section (`critic:`) keeps its defaults
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'}={data!r}: expected a mapping of "
                          f"{type(obj).__name__} keys")
    for name, value in data.items():
        key = _join(prefix, str(name))
        tp = _field_type(type(obj), str(name), key)
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, name), value, key)
        else:
            setattr(obj, name, _convert(value, tp, key))


def _set_path(obj: Any, parts: list[str], value: Any, prefix: str) -> None:
    name, rest = parts[0], parts[1:]
    key = _join(prefix, name)
    tp = _field_type(type(obj), name, key)
    if not rest:
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, name), value, key)
        else:
            setattr(obj, name, _convert(value, tp, key))
    elif dataclasses.is_dataclass(tp):
        _set_path(getattr(obj, name), rest, value, key)
    elif _strip_optional(tp) is dict:  # free-form dicts (model.config, override_config) take sub-keys
        new = copy.deepcopy(getattr(obj, name)) or {}
        node = new
        for part in rest[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[rest[-1]] = value
        setattr(obj, name, new)
    else:
        raise ConfigError(f"{key} is a {_describe(tp)}, not a section: cannot set "
                          f"{_join(key, '.'.join(rest))}; set {key}=VALUE")


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _field_type(cls: type, name: str, key: str) -> Any:
    hints = _hints(cls)
    if name not in hints:
        raise ConfigError(_unknown_key_message(key, cls))
    return hints[name]


@functools.cache
def all_keys() -> tuple[str, ...]:
    """Every dotted key of the schema (sections and leaves)."""
    out = []

    def walk(cls, prefix):
        for name, tp in _hints(cls).items():
            key = _join(prefix, name)
            out.append(key)
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
    walk(TridentConfig, "")
    return tuple(out)


def _unknown_key_message(key: str, cls: type) -> str:
    if key in MOVED_KEYS:
        return f"unknown config key {key!r}: in this engine it is {MOVED_KEYS[key]!r}"
    parent, _, leaf = key.rpartition(".")
    siblings = list(_hints(cls))
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"unknown config key {key!r}; did you mean {_join(parent, close[0])!r}?"
    elsewhere = [k for k in all_keys() if k.rpartition(".")[2] == leaf]  # right name, wrong section
    if elsewhere:
        return f"unknown config key {key!r}; did you mean {' or '.join(repr(k) for k in elsewhere[:3])}?"
    return (f"unknown config key {key!r}; valid keys under {parent or 'the top level'!r}: "
            f"{', '.join(siblings)}")


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = _strip_optional(tp)
        return f"{_describe(inner)} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"list of {_describe(args[0])}"
    if tp is float:
        return "float (a number)"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints become floats for float keys."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return copy.deepcopy(value)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        return _convert(value, _strip_optional(tp), key)
    if value is None:
        raise ConfigError(f"{key}=null is not allowed: expected {_describe(tp)}")
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ConfigError(f"{key}={value!r} is not allowed: use one of "
                          + ", ".join(repr(a) for a in args))
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # `data.train_files=a.parquet`
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected {_describe(tp)}, "
                              f"got {type(value).__name__}; write a list like [a, b]")
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict)}[tp]
    if not ok(value):
        hint = "; quote it to make it a string" if tp is str else ""
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_describe(tp)}, "
                          f"got {type(value).__name__}{hint}")
    if tp is float:
        return float(value)
    return copy.deepcopy(value)


# --------------------------------------------------------------------------------------------
# Value validation (layout-independent; layout checks live in validate_layout)
# --------------------------------------------------------------------------------------------

def _fail(key: str, value: Any, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={value!r}: {fix}")


def _check(obj: Any, prefix: str, name: str, *, gt=None, ge=None, le=None,
           allow=(), optional=False) -> None:
    """Range check on obj.name; `allow` lists extra accepted sentinels (e.g. -1 = off)."""
    value = getattr(obj, name)
    if (value is None and optional) or value in allow:
        return
    rules = [(gt, f"> {gt}", lambda v: v > gt), (ge, f">= {ge}", lambda v: v >= ge),
             (le, f"<= {le}", lambda v: v <= le)]
    wanted = [text for bound, text, _ in rules if bound is not None]
    finite = not isinstance(value, float) or math.isfinite(value)
    if not finite or not all(ok(value) for bound, _, ok in rules if bound is not None):
        sentinel = "".join(f" (or {a!r} to turn it off)" for a in allow)
        want = " and ".join(wanted) if wanted else "a finite number"
        _fail(_join(prefix, name), value, f"must be {want}{sentinel}; set a value in that range")


def validate(cfg: TridentConfig) -> None:
    """Raise ConfigError for the first impossible value or inconsistent combination."""
    _validate_data(cfg.data)
    arr = cfg.actor_rollout_ref
    if arr.actor.megatron.params_dtype is None:
        _fail("actor_rollout_ref.actor.megatron.params_dtype", None,
              "the actor's parameter dtype must be set: float32, bfloat16 or float16")
    if not arr.hybrid_engine:
        _fail("actor_rollout_ref.hybrid_engine", False,
              "only the colocated hybrid engine is implemented; set it to true")
    _validate_model(arr.model, "actor_rollout_ref.model", cfg.data, required=True)
    _validate_actor(cfg)
    _validate_rollout(cfg)
    ref = arr.ref
    _check(ref, "actor_rollout_ref.ref", "log_prob_micro_batch_size_per_gpu", ge=1, optional=True)
    _check(ref, "actor_rollout_ref.ref", "log_prob_max_token_len_per_gpu", ge=1, optional=True)
    _validate_megatron(ref.megatron, "actor_rollout_ref.ref.megatron", is_actor=False)
    _validate_critic(cfg)
    _validate_reward_model(cfg.reward_model)
    _validate_algorithm(cfg)
    _validate_trainer(cfg)


def _validate_data(data: DataConfig) -> None:
    p = "data"
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        _check(data, p, name, ge=1)
    _check(data, p, "val_batch_size", ge=1, optional=True)
    _check(data, p, "dataloader_num_workers", ge=0)
    if not data.prompt_key:
        _fail("data.prompt_key", data.prompt_key, "set the parquet column holding the prompt, e.g. 'prompt'")
    if not data.train_files and data.builtin_task is None:
        _fail("data.train_files", data.train_files,
              "no training data: set data.train_files to parquet file(s) or data.builtin_task (e.g. 'arith')")
    if data.train_files and data.builtin_task is not None:
        _fail("data.builtin_task", data.builtin_task,
              f"data.train_files={data.train_files!r} is also set; use one source: set builtin_task=null "
              f"or train_files=[]")


def _validate_model(model: ModelConfig, prefix: str, data: DataConfig, required: bool) -> None:
    if model.path is not None and model.config is not None:
        _fail(f"{prefix}.config", "{...}", f"{prefix}.path={model.path!r} is also set; model.config builds a "
              f"random model, so set only one (use {prefix}.override_config to change a pretrained config)")
    if required and model.path is None and model.config is None:
        _fail(f"{prefix}.path", None, "set it to a HF model directory, or set model.config to an inline "
              "HF config dict to build a random model")
    if (required and model.config is not None and model.tokenizer_path is None
            and data.builtin_task is None):
        _fail(f"{prefix}.tokenizer_path", None, "a model built from model.config has no tokenizer: set "
              "tokenizer_path or data.builtin_task")


def _validate_optim(optim: OptimConfig, prefix: str) -> None:
    _check(optim, prefix, "lr", ge=0.0)
    _check(optim, prefix, "min_lr", ge=0.0, le=optim.lr)
    _check(optim, prefix, "lr_warmup_steps", ge=0, allow=(-1,))
    _check(optim, prefix, "lr_warmup_steps_ratio", ge=0.0, le=1.0)
    _check(optim, prefix, "weight_decay", ge=0.0)
    _check(optim, prefix, "eps", gt=0.0)
    _check(optim, prefix, "clip_grad", gt=0.0)
    _check(optim, prefix, "total_training_steps", ge=1, optional=True)
    if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
        _fail(f"{prefix}.betas", optim.betas, "must be two numbers in [0, 1), e.g. [0.9, 0.999]")


def _validate_megatron(m: MegatronConfig, prefix: str, is_actor: bool) -> None:
    for name in LAYOUT_KEYS:
        value = getattr(m, name)
        nullable = (not is_actor or name in ("virtual_pipeline_model_parallel_size",
                                             "expert_tensor_parallel_size"))
        if value is None and not nullable:
            _fail(f"{prefix}.{name}", None, "the actor defines the parallel layout; set it "
                  f"(e.g. {False if name == 'sequence_parallel' else 1})")
        if name != "sequence_parallel":
            _check(m, prefix, name, ge=1, optional=True)
    _check(m, prefix, "recompute_num_layers", ge=1, optional=True)
    if m.recompute_granularity == "full" and m.recompute_method is None:
        _fail(f"{prefix}.recompute_method", None, "recompute_granularity='full' needs a method: set "
              "'uniform' or 'block' (and recompute_num_layers)")
    if m.recompute_granularity != "full" and m.recompute_method is not None:
        _fail(f"{prefix}.recompute_method", m.recompute_method,
              f"only used with recompute_granularity='full' (it is {m.recompute_granularity!r}); set it to null")


def _validate_actor(cfg: TridentConfig) -> None:
    actor, p = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor"
    _validate_ppo_batching(actor, p, cfg, micro_required=True)
    _check(actor, p, "ppo_epochs", ge=1)
    _check(actor, p, "clip_ratio", gt=0.0)
    _check(actor, p, "clip_ratio_low", gt=0.0, optional=True)
    _check(actor, p, "clip_ratio_high", gt=0.0, optional=True)
    _check(actor, p, "clip_ratio_c", gt=1.0)
    _check(actor, p, "entropy_coeff")
    _check(actor, p, "kl_loss_coef", ge=0.0)
    _validate_optim(actor.optim, f"{p}.optim")
    _validate_megatron(actor.megatron, f"{p}.megatron", is_actor=True)


def _validate_ppo_batching(section: Any, p: str, cfg: TridentConfig, micro_required: bool) -> None:
    """Mini-batch counts prompts (verl); micro-batch counts sequences per rank."""
    _check(section, p, "ppo_mini_batch_size", ge=1, optional=True)
    _check(section, p, "ppo_micro_batch_size_per_gpu", ge=1, optional=True)
    _check(section, p, "ppo_max_token_len_per_gpu", ge=1)
    mini, batch = section.ppo_mini_batch_size, cfg.data.train_batch_size
    if mini is not None and batch % mini:
        options = ", ".join(str(d) for d in _divisors(batch)[-6:])
        _fail(f"{p}.ppo_mini_batch_size", mini,
              f"must divide data.train_batch_size={batch} (both count prompts, so mini x rollout.n "
              f"divides train_batch_size x rollout.n); use one of {options}")
    if section.use_dynamic_bsz:
        need = cfg.data.max_prompt_length + cfg.data.max_response_length
        if section.ppo_max_token_len_per_gpu < need:
            _fail(f"{p}.ppo_max_token_len_per_gpu", section.ppo_max_token_len_per_gpu,
                  f"must fit one full sequence (data.max_prompt_length + max_response_length = {need}); "
                  f"set it to at least {need}")
    elif section.ppo_micro_batch_size_per_gpu is None and micro_required:
        _fail(f"{p}.ppo_micro_batch_size_per_gpu", None,
              f"set the per-rank micro-batch (sequences), or set {p}.use_dynamic_bsz=true")


def _validate_sampling(s: Any, p: str) -> None:
    _check(s, p, "temperature", ge=0.0)
    _check(s, p, "top_p", gt=0.0, le=1.0)
    _check(s, p, "top_k", ge=1, allow=(-1,))
    _check(s, p, "n", ge=1)


def _validate_rollout(cfg: TridentConfig) -> None:
    r, p = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    _validate_sampling(r, p)
    _validate_sampling(r.val_kwargs, f"{p}.val_kwargs")
    for name in ("prompt_length", "response_length", "log_prob_micro_batch_size_per_gpu",
                 "log_prob_max_token_len_per_gpu"):
        _check(r, p, name, ge=1, optional=True)
    for name in ("tensor_model_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                 "update_weights_bucket_megabytes"):
        _check(r, p, name, ge=1)
    _check(r, p, "gpu_memory_utilization", gt=0.0, le=1.0)
    for i, token in enumerate(r.stop_token_ids):
        if token < 0:
            _fail(f"{p}.stop_token_ids[{i}]", token, "token ids are >= 0")
    if r.name == "sglang" and cfg.trainer.device == "cpu":
        _fail(f"{p}.name", "sglang", "SGLang needs a GPU but trainer.device='cpu'; use rollout.name=cpu")


def _validate_critic(cfg: TridentConfig) -> None:
    c, p = cfg.critic, "critic"
    if c.enable is False and cfg.algorithm.adv_estimator == "gae":
        _fail("critic.enable", False, "algorithm.adv_estimator='gae' needs a critic; set critic.enable=true "
              "(or null), or pick an estimator without a critic such as 'grpo'")
    _validate_model(c.model, "critic.model", cfg.data, required=False)
    _validate_ppo_batching(c, p, cfg, micro_required=False)  # null: the actor's
    _check(c, p, "ppo_epochs", ge=1, optional=True)
    _check(c, p, "cliprange_value", gt=0.0)
    _validate_optim(c.optim, f"{p}.optim")
    _validate_megatron(c.megatron, f"{p}.megatron", is_actor=False)


def _validate_reward_model(rm: RewardModelConfig) -> None:
    p = "reward_model"
    _check(rm, p, "num_workers", ge=0)
    _check(rm, p, "micro_batch_size_per_gpu", ge=1, optional=True)
    _check(rm.overlong_buffer, f"{p}.overlong_buffer", "len", ge=0)
    _check(rm.overlong_buffer, f"{p}.overlong_buffer", "penalty_factor", ge=0.0)
    _validate_megatron(rm.megatron, f"{p}.megatron", is_actor=False)
    if rm.enable and rm.model.path is None:
        _fail("reward_model.model.path", None, "reward_model.enable=true needs a reward model directory; "
              "set it, or set reward_model.enable=false to use rule rewards")
    if rm.enable and rm.micro_batch_size_per_gpu is None:
        _fail("reward_model.micro_batch_size_per_gpu", None, "set the per-rank scoring micro-batch (sequences)")


def _validate_algorithm(cfg: TridentConfig) -> None:
    a, p = cfg.algorithm, "algorithm"
    _check(a, p, "gamma", ge=0.0, le=1.0)
    _check(a, p, "lam", ge=0.0, le=1.0)
    _check(a.kl_ctrl, f"{p}.kl_ctrl", "kl_coef", ge=0.0)
    _check(a.kl_ctrl, f"{p}.kl_ctrl", "horizon", ge=1)
    _check(a.kl_ctrl, f"{p}.kl_ctrl", "target_kl", gt=0.0)
    g = f"{p}.kl_guard"
    _check(a.kl_guard, g, "kl_ceiling", gt=0.0)
    _check(a.kl_guard, g, "entropy_floor", ge=0.0)
    _check(a.kl_guard, g, "raise_factor", ge=1.0)
    _check(a.kl_guard, g, "lower_factor", gt=0.0, le=1.0)
    n = cfg.actor_rollout_ref.rollout.n
    if a.adv_estimator in GROUP_ESTIMATORS and n < 2:
        _fail("actor_rollout_ref.rollout.n", n, f"algorithm.adv_estimator={a.adv_estimator!r} compares the "
              "responses to one prompt, so it needs at least 2; set rollout.n >= 2 (e.g. 4)")


def _validate_trainer(cfg: TridentConfig) -> None:
    t, p = cfg.trainer, "trainer"
    for name in ("nnodes", "n_gpus_per_node", "total_epochs"):
        _check(t, p, name, ge=1)
    _check(t, p, "total_training_steps", ge=1, optional=True)
    _check(t, p, "test_freq", ge=1, allow=(-1,))
    _check(t, p, "save_freq", ge=1, allow=(-1,))
    _check(t, p, "max_actor_ckpt_to_keep", ge=1, optional=True)
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        _fail("trainer.resume_from_path", t.resume_from_path,
              "trainer.resume_mode='resume_path' needs the checkpoint directory to resume from")
    if t.resume_mode != "resume_path" and t.resume_from_path:
        _fail("trainer.resume_from_path", t.resume_from_path,
              f"only read when trainer.resume_mode='resume_path' (it is {t.resume_mode!r}); set one or the other")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _options(n: int) -> str:
    ds = [str(d) for d in _divisors(n)]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


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
                    num_experts: Optional[int] = None) -> None:
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
    rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if world_size % rollout_tp:
        _fail("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp,
              f"does not divide world size {world_size}; use {_options(world_size)}")


def _megatron_sections(cfg: TridentConfig) -> list[tuple[str, MegatronConfig]]:
    return [("actor_rollout_ref.actor.megatron", cfg.actor_rollout_ref.actor.megatron),
            ("actor_rollout_ref.ref.megatron", cfg.actor_rollout_ref.ref.megatron),
            ("critic.megatron", cfg.critic.megatron),
            ("reward_model.megatron", cfg.reward_model.megatron)]


# --------------------------------------------------------------------------------------------
# Derived values: the one place
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    ep: int
    etp: int
    dp: int  # world / (TP x PP x CP)
    expert_dp: int  # world / (PP x EP x ETP)


@dataclass(frozen=True)
class BatchPlan:
    """How one trained model (actor or critic) splits a PPO step's batch."""
    mini_batch_size: int  # sequences per optimizer step over all DP ranks (= prompts x rollout.n)
    mini_batch_size_per_rank: int
    micro_batch_size_per_rank: Optional[int]  # None with use_dynamic_bsz (split by tokens)
    grad_accum_steps: Optional[int]  # micro-batches per mini-batch per rank; None with dynamic bsz
    mini_batches_per_epoch: int
    ppo_epochs: int


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
    expected = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    world_size = expected if world_size is None else world_size
    if world_size != expected:
        _fail("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node,
              f"trainer.nnodes x n_gpus_per_node = {expected} but {world_size} ranks were launched; "
              f"launch {expected} ranks or set nnodes/n_gpus_per_node to match")
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
    if rollout.name == "auto":
        rollout.name = "sglang" if trainer.device == "cuda" else "cpu"
    if rollout.name == "sglang" and trainer.device == "cpu":
        _fail("actor_rollout_ref.rollout.name", "sglang", "SGLang needs a GPU but no CUDA device is available; "
              "use rollout.name=cpu")

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
    critic.enable = out.algorithm.adv_estimator == "gae" if critic.enable is None else critic.enable
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
                    dp=world_size // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                                      * m.context_parallel_size),
                    expert_dp=world_size // (m.pipeline_model_parallel_size * m.expert_model_parallel_size
                                             * m.expert_tensor_parallel_size))
    rollout_batch = data.train_batch_size * rollout.n
    if rollout_batch % layout.dp:
        _fail("data.train_batch_size", data.train_batch_size,
              f"x rollout.n {rollout.n} = {rollout_batch} sequences do not split over {layout.dp} data-parallel "
              f"ranks; make train_batch_size x rollout.n a multiple of {layout.dp}")
    return Derived(
        config=out, layout=layout, rollout_batch_size=rollout_batch,
        rollout_batch_size_per_rank=rollout_batch // layout.dp,
        use_critic=critic.enable,
        use_reference=actor.use_kl_loss or out.algorithm.use_kl_in_reward,
        actor=_batch_plan(actor, "actor_rollout_ref.actor", out, layout.dp),
        critic=_batch_plan(critic, "critic", out, layout.dp) if critic.enable else None)


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
                     ppo_epochs=section.ppo_epochs)
