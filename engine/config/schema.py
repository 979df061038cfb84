"""The recipe schema: typed dataclasses with verl's key names, and the allowed values.

Tests: tests/test_config_keys.py, tests/test_config.py, tests/test_config_paths.py
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from engine.algorithms.advantages import ADVANTAGE_ESTIMATORS
from engine.algorithms.losses import LOSS_AGG_MODES, POLICY_LOSSES
from engine.errors import UserError
from engine.metrics import LOGGERS
from engine.algorithms.pair_losses import DPO_LOSSES
from engine.config.rollout_correction import RolloutCorrectionConfig
from engine.config.schema_sources import CustomClsConfig, RemoteRewardConfig
from engine.rollout.registry import backend_names
from engine.tasks import BuiltinTask
from kernels.kl import KL_KINDS


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class ConfigError(UserError):
    """A recipe problem: names the dotted key, the offending value and how to fix it."""


# --------------------------------------------------------------------------------------------
# Allowed values
# --------------------------------------------------------------------------------------------

# Names that select code come from the tables beside that code (adding one there adds it here).
Truncation = Literal["error", "left", "right", "filter"]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]
LossAggMode = Literal[tuple(LOSS_AGG_MODES)]
# "+" variants: the value of the named estimator with the gradient of k2 (straight-through).
KlEstimator = Literal[tuple(KL_KINDS)]
LrDecayStyle = Literal["constant", "linear", "cosine"]
ParamsDtype = Literal["float32", "bfloat16", "float16"]
# how a trained model's state is spread over data parallel: Megatron's DDP + distributed optimizer,
# or parameters, gradients and optimizer state all sharded (verl's fsdp / fsdp2: parallel/fsdp.py)
Strategy = Literal["megatron", "fsdp", "fsdp2"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
CheckpointContent = Literal["model", "optimizer", "extra"]
RolloutName = Literal[backend_names() + ("auto",)]  # hf: transformers on CUDA (checks)
RewardManager = Literal["naive", "batch", "dapo", "prime"]
AdvEstimator = Literal[tuple(ADVANTAGE_ESTIMATORS)]
KlCtrlType = Literal["fixed", "adaptive"]
Logger = Literal[tuple(LOGGERS)]
Device = Literal["auto", "cpu", "cuda"]
ResumeMode = Literal["auto", "disable", "resume_path"]
Task = Literal["ppo", "reward_model", "dpo", "sft"]  # what a recipe trains (engine/offline: the others)
DpoLossType = Literal[tuple(DPO_LOSSES)]
TokenLevel = Literal["margin", "implicit"]  # reward_model.token_level (null: score on the last token)
ReplayFilter = Literal["best", "best_worst", "reweight"]  # PF-PPO policy filtration (engine/experience/replay.py)

# Estimators that compare responses within a group of n samples per prompt / need a critic.
GROUP_ESTIMATORS = tuple(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.group)
CRITIC_ESTIMATORS = tuple(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.critic)
# Keys that share one Megatron process-group layout across all models of a run.
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")

# verl names Trident reads as its own key (one note in the log): name -> (key, why)
ALIASES = {
    "data.use_sequence_packing": ("actor_rollout_ref.model.use_remove_padding",
                                  "sequence packing is the remove-padding THD packing here"),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": (
        "actor_rollout_ref.model.use_fused_kernels",
        "entropy (and log-probs) are computed chunked by the fused kernel"),
}

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
    # parquet file(s), HF datasets directories or JSON files (engine/data/sources.py); a lone string is accepted
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_split: str = "train"  # a HF dataset's split (several splits in one source)
    val_split: Optional[str] = None  # null: 'validation', else 'test', else its only split
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)  # verl's: a user's dataset class
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per PPO step
    gen_batch_size: Optional[int] = None  # separate pool: prompts per generation batch (null: train_batch_size)
    val_batch_size: Optional[int] = None  # null: the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    truncation: Truncation = "error"  # over-long prompts: raise, cut left/right, or drop them
    filter_overlong_prompts: bool = False  # same as truncation='filter' (derive() makes both agree)
    return_raw_chat: bool = False
    chat_template: bool = True  # format prompts with the tokenizer's chat template
    builtin_task: Optional[BuiltinTask] = None  # built-in synthetic task (engine/tasks.py) instead of files
    builtin_task_difficulty: int = 0  # engine/tasks.py difficulty levels (0 = easiest)
    dataloader_num_workers: int = 0
    # Preference pairs (trainer.task reward_model / dpo), verl's RM dataset names
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: Optional[str] = None  # reward model: a column of per-pair margins (Bradley-Terry)
    # SFT conversations (trainer.task sft, engine/data/sft.py), verl's SFT dataset names
    messages_key: str = "messages"  # a list of {role, content[, tool_calls]} messages
    tools_key: str = "tools"  # optional column of tool schemas passed to the chat template
    max_length: int = 1024  # tokens of a whole conversation (data.truncation beyond it)
    # Offline PPO / GRPO from logged responses (engine/experience/logged.py, engine/data/logged.py): parquet with the
    # prompt (prompt_key), `response` (text or token ids), `reward` or `score`, and optionally
    # `rollout_log_probs` (the behaviour policy's, one per response token); no generation
    offline_path: Optional[str] = None


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
    # LoRA (verl's keys; actor only): adapters of rank lora_rank (0 = off) on the linear layers
    # named by target_modules (HF names q_proj ... down_proj, Megatron names linear_qkv ...,
    # or "all-linear"), scaled by lora_alpha / lora_rank; the base stays frozen.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


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
    tp_comm_overlap: bool = False  # refused when true: needs TransformerEngine userbuffers
    # strategy fsdp / fsdp2 only (parallel/fsdp.py; verl's fsdp_config keys of the same names):
    # free each layer's gathered parameters after its forward (false: keep them until backward)
    # and gather the next layer's during this one's forward
    reshard_after_forward: bool = True
    forward_prefetch: bool = False
    recompute_granularity: Optional[RecomputeGranularity] = None
    recompute_method: Optional[RecomputeMethod] = None
    recompute_num_layers: Optional[int] = None
    seed: int = 42  # the actor's seeds the process (ref / critic / reward model: only 42)
    params_dtype: Optional[ParamsDtype] = "bfloat16"  # ref / critic / reward model: null = the actor's
    # Megatron's kernel fusions by name (engine/models/builder.py FUSIONS): absent = on where the
    # installed TE / apex support it on a GPU (always off on CPU), true = required, false = off
    fusions: dict = field(default_factory=dict)


def _inherited_megatron() -> MegatronConfig:
    return MegatronConfig(tensor_model_parallel_size=None, pipeline_model_parallel_size=None,
                          context_parallel_size=None, expert_model_parallel_size=None,
                          sequence_parallel=None, params_dtype=None)


@dataclass
class CheckpointConfig:
    save_contents: list[CheckpointContent] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class ActorConfig:
    strategy: Strategy = "megatron"
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
class MultiTurnConfig:
    """verl's `rollout.multi_turn` keys: trajectories of model turns and tool / environment
    observations (engine/rollout/multi_turn.py, tool_actor.py; tools, parsers: engine/agents/)."""
    enable: bool = False
    max_assistant_turns: Optional[int] = None  # null: until the response budget is spent
    max_user_turns: Optional[int] = None  # observations (tool results, environment turns)
    tool_config_path: Optional[str] = None  # verl's tool config YAML (null: the built-ins)
    interaction_config_path: Optional[str] = None  # verl's interaction (environment) config YAML
    max_tool_response_length: int = 256  # characters of a tool result kept (verl's)
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    format: str = "hermes"  # the tool-call parser (engine/agents/parsers.py registry)
    tool_timeout_s: float = 30.0  # a call still running after this becomes an error observation
    # the tools' schemas rendered into each prompt by the chat template (`tools=`, as verl does);
    # false: the prompt as the data has it (a model trained on prompts without them)
    tools_in_prompt: bool = True


@dataclass
class RolloutConfig:
    name: RolloutName = "auto"  # auto: sglang on cuda, cpu otherwise; hf: transformers on CUDA
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
    # GPU engines (sglang: disable_cuda_graph / chunked_prefill_size -1; vllm: its own keys); the
    # CPU backends run eagerly and prefill whole prompts whatever these say
    enforce_eager: bool = False  # no CUDA graphs
    enable_chunked_prefill: bool = True  # prefill in chunks of max_num_batched_tokens
    free_cache_engine: bool = True
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    update_weights_bucket_megabytes: int = 512
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # null: actor's ppo_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null: actor's use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null: actor's ppo_max_token_len_per_gpu
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # always generate response_length tokens (throughput benchmarks)
    # sglang: enable_deterministic_inference + a seed per sample (bit-identical resume); cpu: always
    deterministic: bool = False
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class RefConfig:
    strategy: Optional[Strategy] = None  # null: the actor's
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
    strategy: Optional[Strategy] = None  # null: the actor's
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
    """DAPO's overlong reward shaping: responses longer than max_response_length - len lose up
    to penalty_factor, linearly over the last `len` tokens (engine/rewards/manager.py)."""
    enable: bool = False
    len: int = 0  # tokens before max_response_length where the length penalty starts
    penalty_factor: float = 1.0


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # required when enabled
    megatron: MegatronConfig = field(default_factory=_inherited_megatron)
    # naive: the reward function per sample; batch: custom_reward_function once per step with lists;
    # verl's dapo: naive (+ overlong_buffer, which any manager applies); prime: naive in num_workers processes
    reward_manager: RewardManager = "naive"
    num_workers: int = 0  # Ray pool size for rule rewards; 0: in process
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # code rewards' sandbox limits: the fields of engine.rewards.sandbox.SandboxConfig (timeout_s,
    # cpu_s, memory_mb, max_file_mb, max_procs, network, max_concurrency, ...), checked there
    sandbox: dict = field(default_factory=dict)
    # The model's reward per token (engine/rewards/manager.py): null = its score on the last
    # token; margin = the score spread evenly over the response tokens; implicit = DPO's
    # beta * (log pi_dpo - log pi_ref) per token, model.path a DPO policy's HF export
    token_level: Optional[TokenLevel] = None
    rule_reward: bool = True  # false: the model's reward alone trains (validation still uses the rule)
    url: Optional[str] = None  # a reward service (HTTP, JSON), scored in place of the rule rewards
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class CustomRewardFunctionConfig:
    """verl's custom_reward_function: a user's reward function from a Python file
    (engine/rewards/custom.py); it replaces the rule rewards by data source."""
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class KlCtrlConfig:
    type: KlCtrlType = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class KlGuardConfig:
    """The users' runbook, automated (engine/algorithms/kl.py KLGuard)."""
    enable: bool = False
    kl_ceiling: float = 0.3     # KL above this: coefficient x raise_factor
    entropy_floor: float = 0.1  # entropy below this: coefficient x lower_factor
    raise_factor: float = 1.2
    lower_factor: float = 0.9
    warn_range: list[float] = field(default_factory=lambda: [0.0005, 0.01])  # warn outside it


@dataclass
class DpoConfig:
    """trainer.task=dpo (TRL's names)."""
    beta: float = 0.1
    loss_type: DpoLossType = "sigmoid"
    # true: the data's ref_chosen_logps / ref_rejected_logps columns (summed log-probs of the
    # responses under the reference) replace the reference model, which is then not built
    precomputed_ref_log_probs: bool = False


@dataclass
class ReplayConfig:
    """Replay buffer and PF-PPO policy filtration (engine/experience/replay.py)."""
    enable: bool = False
    capacity: int = 4      # steps whose groups the buffer keeps (per DP rank, on CPU)
    ratio: float = 0.0     # replayed prompt groups per fresh group in a training batch
    filter: Optional[ReplayFilter] = None  # PF-PPO: best | best_worst responses of each group, or reweight
    keep: float = 0.5      # best / best_worst: the fraction of each prompt's rollout.n responses kept
    weight_pow: float = 2.0  # reweight: the policy gradient of a response x |score|^weight_pow (mean 1)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (verl's keys; engine/experience/dynamic_sampling.py): prompt groups whose
    `metric` is equal over all their responses are dropped and generation goes on until the
    batch is full."""
    enable: bool = False
    metric: str = "seq_reward"  # seq_reward | seq_final_reward | a reward extra (e.g. acc)
    max_num_gen_batches: int = 10  # generation batches per step at most (0: no bound)


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
    dpo: DpoConfig = field(default_factory=DpoConfig)  # beta also sets reward_model.token_level=implicit's
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


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
    checkpoint_verify: Literal["checksum", "size"] = "checksum"  # what loading checks in the manifest
    max_actor_ckpt_to_keep: Optional[int] = None  # null: keep all
    save_hf: bool = False
    log_dir: Optional[str] = None  # null: logs/{project_name}/{experiment_name}
    profile_comm: bool = False  # time spent blocked in collectives per phase (perf/comm_s/*)
    # even tokens per DP rank: whole prompt groups reordered over the DP ranks after generation,
    # every global mini-batch unchanged (engine/experience/balance.py; global_seqlen/* metrics).
    # verl's default is true; ours is off: it changes which rank holds which rows. Enable it
    balance_batch: bool = False
    seed: int = 1
    # Never lose a run (engine/trainer.py, engine/workers/template.py):
    oom_retry: int = 2                # out of memory in a micro-batch: retries at half the size (0: off)
    max_nonfinite_skips: int = 3      # consecutive steps with NaN / Inf skipped before rolling back
    rollback_lr_factor: float = 0.5   # the LR after a rollback to the last good checkpoint
    collective_timeout_s: int = 600   # a collective waiting longer ends the job, naming rank and phase
    # (joining the job at start waits max(this, parallel.mesh.RENDEZVOUS_TIMEOUT_S))
    # colocated: every rank trains and generates (hybrid engine); separate: the last
    # rollout_pool_ranks ranks only generate (engine/rollout/pool.py)
    rollout_pool: Literal["colocated", "separate"] = "colocated"
    rollout_pool_ranks: int = 0
    off_policy_steps: int = 0  # k: steps up to t+k generate while step t trains (separate pool)
    partial_rollout: bool = False  # new weights pause the pool's generations, which go on from their tokens
    rollout_pool_max_restarts: int = 0  # engine.launch_ray replaces a dead pool rank this many times
    # ppo; reward_model (Bradley-Terry on preference pairs); dpo; sft (conversations). The
    # offline tasks train the actor_rollout_ref.model with the actor's optim / megatron /
    # micro-batch keys
    task: Task = "ppo"

    def due(self, freq_key: str, step: int, total: int) -> bool:
        """Whether validation (test_freq) or a checkpoint (save_freq) is due after `step`:
        every `freq` steps and at the last one; never with freq <= 0."""
        freq = getattr(self, freq_key)
        return freq > 0 and (step % freq == 0 or step == total)


@dataclass
class GlobalProfilerConfig:  # verl's; engine/profiler.py
    tool: Optional[Literal["torch"]] = None  # null: off
    steps: Optional[list[int]] = None  # the training steps profiled (1-based)
    save_path: str = "outputs/profile"


@dataclass
class TridentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)

