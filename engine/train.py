"""`torchrun --nproc_per_node N -m engine.train RECIPE.yaml key=value ...`

Builds everything a PPO run needs from the recipe (layout, tokenizer, data, actor / reference /
critic on Megatron, rollout engine, rewards, checkpoints) and runs the Trainer; with
`trainer.task: reward_model | dpo` the offline trainer of engine/offline instead.
"""
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class Components:
    tokenizer: Any
    hf_config: Any
    actor: Any
    ref: Optional[Any]
    critic: Optional[Any]
    rollout: Any
    reward_fn: Any
    train_data: Any
    val_data: Optional[Any]
    checkpoints: Optional[Any]
    peak_flops: Optional[float]
    reward_model: Optional[Any] = None
    watch: Optional[Any] = None  # engine.guards.CollectiveWatch
    bridge: Optional[Any] = None  # engine.rollout.pool.Bridge to a separate rollout pool


def load_hf_config(model_cfg, vocab_size=None):
    """The HF config of the model: from `model.path`, or built from the inline `model.config`."""
    import transformers
    if model_cfg.path:
        cfg = transformers.AutoConfig.from_pretrained(model_cfg.path,
                                                      trust_remote_code=model_cfg.trust_remote_code)
    else:
        inline = dict(model_cfg.config)
        model_type = inline.pop("model_type", None)
        if model_type is None:
            raise ValueError("actor_rollout_ref.model.config needs a model_type (e.g. llama)")
        cfg = transformers.AutoConfig.for_model(model_type, **inline)
    for key, value in (model_cfg.override_config or {}).items():
        setattr(cfg, key, value)
    if not getattr(cfg, "architectures", None):
        from engine.models.arch import architecture_of
        cfg.architectures = [architecture_of(cfg)]
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(f"the model's vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size} tokens; set actor_rollout_ref.model.config.vocab_size >= "
                         f"{vocab_size}")
    return cfg


def load_tokenizer(cfg):
    from transformers import AutoTokenizer
    model = cfg.actor_rollout_ref.model
    path = model.tokenizer_path or model.path
    if path:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    if cfg.data.builtin_task:
        from engine.tasks import build_tokenizer
        return build_tokenizer()
    raise ValueError("no tokenizer: set actor_rollout_ref.model.tokenizer_path or model.path")


def load_datasets(cfg, tokenizer):
    from engine.data import PromptDataset
    data = cfg.data
    kw = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length,
              truncation=data.truncation, prompt_key=data.prompt_key,
              apply_chat_template=data.chat_template)
    if data.builtin_task:
        from engine.tasks import make_builtin_task
        train_rows, val_rows, _ = make_builtin_task(data.builtin_task, seed=data.seed,
                                                    difficulty=data.builtin_task_difficulty)
        return PromptDataset(train_rows, **kw), PromptDataset(val_rows, **kw)
    train = PromptDataset(list(data.train_files), **kw)
    val = PromptDataset(list(data.val_files), **kw) if data.val_files else None
    return train, val


def copy_weights(src_chunks, dst_chunks):
    """Same layout, same model: the reference starts as the actor."""
    from parallel.shards import local_shards
    src = {s.global_name: p for p, s in local_shards(src_chunks)}
    with torch.no_grad():
        for p, s in local_shards(dst_chunks):
            if s.global_name in src and src[s.global_name].shape == p.shape:
                p.copy_(src[s.global_name])


def build(cfg, world_size, watch=None, bridge=None) -> Components:
    """Every component of a run, on this rank, from a validated config."""
    from engine.config import derive
    from engine.perf import peak_flops_per_rank
    from engine.rewards.manager import RewardManager
    from engine.workers.actor import ActorWorker, ReferenceWorker
    from engine.workers.critic import CriticWorker
    from parallel.mesh import init_mesh

    tokenizer = load_tokenizer(cfg)
    train_data, val_data = load_datasets(cfg, tokenizer)
    derived = derive(cfg, world_size, dataset_len=len(train_data))
    cfg = derived.config
    arr = cfg.actor_rollout_ref
    init_mesh(derived.layout, seed=arr.actor.megatron.seed, timeout_s=cfg.trainer.collective_timeout_s)
    hf_config = load_hf_config(arr.model, vocab_size=len(tokenizer))
    from engine.config import validate_layout
    from engine.models.arch import arch_spec
    spec = arch_spec(hf_config)  # the shape checks that need the model: layers, experts, heads
    validate_layout(cfg, world_size, num_layers=spec.transformer["num_layers"],
                    num_experts=spec.num_experts or 0,
                    num_attention_heads=hf_config.num_attention_heads)
    steps = cfg.trainer.total_training_steps
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    response_length = arr.rollout.response_length
    actor = ActorWorker(hf_config, arr.actor, arr.model, total_steps=steps, pad_token_id=pad,
                        response_length=response_length)
    critic = ref = None
    if derived.use_critic:  # its own model (critic.model.path / config; the actor's when unset)
        own = (cfg.critic.model.path, cfg.critic.model.config) != (arr.model.path, arr.model.config)
        critic_hf = load_hf_config(cfg.critic.model, vocab_size=len(tokenizer)) if own else hf_config
        critic = CriticWorker(critic_hf, cfg.critic, cfg.critic.model, total_steps=steps,
                              pad_token_id=pad, response_length=response_length)
    # a LoRA actor's reference is its own base (adapters off): no second model is built
    if derived.use_reference and actor.lora is None:
        ref = ReferenceWorker(hf_config, arr.ref.megatron, arr.model, pad_token_id=pad)
    from engine.models.hf_io import load_hf_weights
    if arr.model.path:
        for worker in (w for w in (actor, ref) if w is not None):
            load_hf_weights(worker.chunks, arr.model.path)
    elif ref is not None:
        copy_weights(actor.chunks, ref.chunks)
    if critic is not None and cfg.critic.model.path:
        # a reward model's checkpoint initialises the value head from its score head
        load_hf_weights(critic.chunks, cfg.critic.model.path, hf_config=critic.hf_config)
    for worker in (actor, critic):
        if worker is not None and worker.optimizer is not None:
            worker.optimizer.reload_model_params()
    if derived.use_reference and actor.lora is not None:
        ref = actor.base_reference()
    separate = cfg.trainer.rollout_pool == "separate"  # then the rollout lives on the pool's ranks
    rollout = None if separate else build_rollout(cfg, derived.rollout_topology, hf_config, tokenizer)
    from engine.rewards import sandbox
    sandbox.configure(cfg.reward_model.sandbox)  # code rewards (and Ray reward workers) use it
    custom = None
    if cfg.custom_reward_function.path:
        from engine.rewards.custom import load_custom_reward
        custom = load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    reward_fn = RewardManager(tokenizer, compute_score=custom, num_workers=cfg.reward_model.num_workers,
                              reward_manager=cfg.reward_model.reward_manager,
                              overlong=cfg.reward_model.overlong_buffer,
                              max_response_length=arr.rollout.response_length)
    reward_model = None
    if cfg.reward_model.enable:  # scores added to the rule rewards (the manager sums them)
        from engine.models.hf_io import load_hf_weights
        from engine.workers.reward_model import RewardModelWorker
        rm_config = load_hf_config(cfg.reward_model.model)
        reward_model = RewardModelWorker(rm_config, cfg.reward_model, pad_token_id=pad)
        load_hf_weights(reward_model.chunks, cfg.reward_model.model.path, hf_config=rm_config)
    checkpoints = None
    if cfg.trainer.save_freq > 0 or cfg.trainer.resume_mode != "disable":
        from engine.checkpoint import CheckpointManager
        checkpoints = CheckpointManager(cfg.trainer.default_local_dir,
                                        keep_last=cfg.trainer.max_actor_ckpt_to_keep,
                                        verify=cfg.trainer.checkpoint_verify)
    peak = peak_flops_per_rank(cfg.trainer.device, actor.params_dtype)
    return derived, Components(tokenizer, hf_config, actor, ref, critic, rollout, reward_fn,
                               train_data, val_data, checkpoints, peak, reward_model, watch, bridge)


def build_rollout(cfg, topology, hf_config, tokenizer, dp_rank=None):
    """This rank's part of the rollout groups; the ranks the topology names build the engine."""
    from megatron.core import parallel_state as ps

    from engine.rollout.group import GroupedRollout
    from engine.rollout.registry import backend_class, check_available, make_rollout

    r = cfg.actor_rollout_ref.rollout
    check_available(r.name)
    eos = [tokenizer.eos_token_id] + list(r.stop_token_ids)

    def engine(placement):
        return make_rollout(r.name, hf_config, eos, **_rollout_kwargs(cfg, hf_config, tokenizer, placement))
    return GroupedRollout(topology, backend_class(r.name), engine,
                          dp_rank=ps.get_data_parallel_rank() if dp_rank is None else dp_rank)


def _rollout_kwargs(cfg, hf_config, tokenizer, placement):
    r, arr = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref
    record = dict(record_routing=True) if arr.actor.router_replay else {}
    if r.name == "sglang":
        return dict(model_path=arr.model.path or _config_dir(hf_config, tokenizer),
                    dtype=arr.actor.megatron.params_dtype, placement=placement,
                    gpu_memory_utilization=r.gpu_memory_utilization,
                    max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs,
                    seed=r.seed, **record)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = dict(pad_token_id=pad, max_num_seqs=r.max_num_seqs, **record)
    if r.name == "hf":  # on the GPU in the actor's dtype
        from engine.workers.base import DTYPES
        out["dtype"] = DTYPES[arr.actor.megatron.params_dtype]
    return out


def _config_dir(hf_config, tokenizer):
    """A model built from an inline config has no directory; SGLang needs one for its config and
    tokenizer (the weights arrive through the hand-off: load_format='dummy')."""
    import tempfile
    path = tempfile.mkdtemp(prefix="trident-rollout-model-")
    hf_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def serve_pool(cfg, bridge, n_train):
    """A separate pool's rank: its part of the rollout groups, serving the trainers' requests."""
    from engine.config import derive
    from engine.rollout.pool import serve
    from engine.trainer import Trainer
    tokenizer = load_tokenizer(cfg)
    derived = derive(cfg, n_train, dataset_len=1 << 30)  # checks the layout; steps do not matter here
    hf_config = load_hf_config(cfg.actor_rollout_ref.model, vocab_size=len(tokenizer))
    group = build_rollout(derived.config, derived.rollout_topology, hf_config, tokenizer, dp_rank=0)
    try:
        serve(bridge, group, n_train, generate=Trainer._engine_generate)
    finally:
        group.shutdown()


def main(argv=None):
    from engine.config import load_config
    from engine.phase import set_phase
    from engine.trainer import Trainer, set_seed
    from parallel.mesh import init_distributed

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip())
        return 2
    recipe, overrides = argv[0], argv[1:]
    cfg = load_config(recipe, overrides)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    from engine.guards import CollectiveWatch, is_collective_failure
    watch = CollectiveWatch().install()
    components, bridge, serving = None, None, False
    if cfg.trainer.rollout_pool == "separate":  # two worlds: trainers, pool (engine/rollout/pool.py)
        from engine.rollout.pool import Bridge, pool_ranks
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        train, pool = pool_ranks(world, cfg.trainer.rollout_pool_ranks)
        bridge = Bridge(rank, world, cfg.trainer.collective_timeout_s)
        serving = rank in pool
        init_distributed(cfg.trainer.collective_timeout_s, ranks=pool if serving else train,
                         name="pool" if serving else "train")
    else:
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    set_seed(cfg.trainer.seed + dist.get_rank())
    try:
        if serving:
            serve_pool(cfg, bridge, len(train))
        elif cfg.trainer.task != "ppo":  # reward model / DPO on preference pairs (engine/offline)
            from engine.offline.build import build_offline
            build_offline(cfg, dist.get_world_size()).fit()
        else:
            derived, components = build(cfg, dist.get_world_size(), watch=watch, bridge=bridge)
            trainer = Trainer(derived, components)
            set_phase("training")
            trainer.fit()
    except Exception as e:
        if not is_collective_failure(e):
            raise
        # a peer died or stopped answering: one line, then leave at once (tearing the process
        # group down would wait for the dead peer); torchrun sees the failure and ends the job
        print(watch.describe(e, cfg.trainer.collective_timeout_s), file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        if components is not None:
            if components.rollout is not None:
                components.rollout.shutdown()
            components.reward_fn.close()
    set_phase("shutdown")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
