"""`torchrun --nproc_per_node N -m engine.train RECIPE.yaml key=value ...`

Builds everything a PPO run needs from the recipe (layout, tokenizer, data, actor / reference /
critic on Megatron, rollout engine, rewards, checkpoints) and runs the Trainer; with
`trainer.task: reward_model | dpo | sft` the offline trainer of engine/offline instead. Which rollout
backend runs, and whether this machine can run it, is engine/rollout/registry.py's answer.

Tests: tests/test_e2e.py, tests/test_bad_inputs.py, tests/test_config_reward_tokenizer.py, tests/test_device_memory.py
"""
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from engine.config import ConfigError
from engine.errors import ModelError
from engine.loading import copy_weights, load_datasets, load_hf_config, load_tokenizer, model_spec


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
    pad_id: Optional[int] = None  # the run's pad id, decided once in prepare (engine.data.pad_token_id)


@dataclass
class Prepared:
    """What `prepare` read and checked before any process group exists."""
    derived: Any
    tokenizer: Any
    train_data: Any
    val_data: Optional[Any]
    hf_config: Any
    reward_model_config: Optional[Any] = None
    pad_id: Optional[int] = None  # engine.data.pad_token_id(tokenizer), decided here once per run


def prepare(cfg, world_size) -> Prepared:
    """Every check that needs no process group and no model: tokenizer, data, layout and batch
    arithmetic, the model's HF config against the layout, the checkpoint to resume. A bad
    recipe, data file or model config fails here, on every rank alike, in seconds."""
    from engine.config import derive, validate_layout
    from engine.data import pad_token_id

    derived = derive(cfg, world_size)  # layout and batch arithmetic first: no file is read
    resolved = derived.config
    tokenizer = load_tokenizer(cfg)
    pad_id = pad_token_id(tokenizer)  # the run's pad id, once: every part that pads gets this one
    model = resolved.actor_rollout_ref.model
    hf_config = load_hf_config(model, vocab_size=len(tokenizer))
    spec = model_spec(hf_config, model)  # the shape checks that need the model: layers, experts, heads
    validate_layout(resolved, world_size, num_layers=spec.transformer["num_layers"],
                    num_experts=spec.num_experts or 0,
                    num_attention_heads=hf_config.num_attention_heads,
                    num_query_groups=spec.transformer.get("num_query_groups"))
    ppo = resolved.trainer.task == "ppo"
    _check_weights(hf_config, model, "actor_rollout_ref.model", "lm" if ppo else None)
    if resolved.trainer.resume_mode == "resume_path":
        from engine.checkpoint import resume_path_problem
        path = resolved.trainer.resume_from_path
        problem = resume_path_problem(path, _trained_workers(derived) if ppo else None)
        if problem:
            raise ConfigError(f"trainer.resume_from_path={path!r}: {problem}")
    if not ppo:  # reward model / DPO / SFT: engine/offline reads its data itself
        return Prepared(derived, tokenizer, None, None, hf_config, pad_id=pad_id)
    critic = resolved.critic.model
    if derived.use_critic and (critic.path, critic.config) != (model.path, model.config):
        critic_hf = load_hf_config(critic, vocab_size=len(tokenizer), key="critic.model")
        model_spec(critic_hf, critic, "critic.model")
        _check_weights(critic_hf, critic, "critic.model", "value")
    if derived.use_critic:  # it reads the policy's token ids: its own tokenizer must agree
        _check_token_ids(tokenizer, critic, model, "critic.model")
    rm_config = None
    if resolved.reward_model.enable:
        rm_config = load_hf_config(resolved.reward_model.model, key="reward_model.model")
        model_spec(rm_config, resolved.reward_model.model, "reward_model.model")
        implicit = resolved.reward_model.token_level == "implicit"  # a DPO policy: a language model
        _check_weights(rm_config, resolved.reward_model.model, "reward_model.model", "lm" if implicit else "value")
        _check_token_ids(tokenizer, resolved.reward_model.model, model, "reward_model.model", rm_config)
    from engine.rollout.registry import rollout_backend
    try:  # this machine runs the derived backend (engine/rollout/registry.py decides)
        rollout_backend(resolved.actor_rollout_ref.rollout.name, resolved.trainer.device, here=True)
    except ValueError as e:  # its messages name the key and the fix
        raise ConfigError(str(e)) from None
    train_data, val_data = load_datasets(cfg, tokenizer)
    _check_dataset_size(cfg, train_data, val_data)
    derived = derive(cfg, world_size, dataset_len=len(train_data))  # now with the step count
    return Prepared(derived, tokenizer, train_data, val_data, hf_config, rm_config, pad_id=pad_id)


def _check_weights(hf_config, model_cfg, key, head):
    """The safetensors headers of `model_cfg.path` against its config (no tensor is read);
    head None: only that they are readable (the head depends on the offline task)."""
    if not model_cfg.path:
        return
    if head is None:
        from engine.models import hf_io
        try:
            hf_io.read_index(model_cfg.path)
        except ModelError as e:
            raise ModelError(f"{key}.path={model_cfg.path!r}: {e}") from None
        return
    from engine.models import hf_io
    try:
        hf_io.validate_checkpoint(hf_config, hf_io.read_index(model_cfg.path), head)
    except ModelError as e:
        raise ModelError(f"{key}.path={model_cfg.path!r}: {e}") from None


def _check_token_ids(tokenizer, model_cfg, actor_model, key, hf_config=None):
    """A model that reads the policy's token ids as they are (engine/workers/reward_model.py and
    the critic: no decode, no re-tokenisation) needs an embedding row for every policy token and
    a tokenizer mapping each to the same id. Its tokenizer: `key.tokenizer_path`, else `key.path`."""
    if hf_config is not None and hf_config.vocab_size < len(tokenizer):
        raise ConfigError(f"{key}.path={model_cfg.path!r}: its vocabulary has {hf_config.vocab_size} tokens, "
                          f"fewer than the policy tokenizer's {len(tokenizer)} tokens; it reads the policy's "
                          "token ids, so use a model trained with the policy's tokenizer")
    where, path = ((f"{key}.tokenizer_path", model_cfg.tokenizer_path) if model_cfg.tokenizer_path
                   else (f"{key}.path", model_cfg.path))
    policy = actor_model.tokenizer_path or actor_model.path
    if path is None or (policy and os.path.realpath(path) == os.path.realpath(policy)):
        return  # a randomly initialised model (no tokenizer of its own), or the policy's tokenizer
    from transformers import AutoTokenizer
    fix = f"set {key}.tokenizer_path to the tokenizer it was trained with, which must be the policy's"
    try:
        own = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}={path!r}: no tokenizer there ({str(e).strip().splitlines()[0][:200]}); "
                          f"{fix}") from None
    theirs = own.get_vocab()
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if theirs.get(token) != i:
            raise ConfigError(f"{where}={path!r}: its tokenizer maps {token!r} to id {theirs.get(token)} where "
                              f"the policy's maps it to {i}; {key} reads the policy's token ids as they are "
                              "(no re-tokenisation), so it needs the same tokenizer: use a model trained with "
                              f"the policy's tokenizer, or {fix}")


def _trained_workers(derived):
    return ["actor"] + (["critic"] if derived.use_critic else [])


def _check_dataset_size(cfg, train_data, val_data):
    """The loader needs one full batch of usable prompts (after filtering)."""
    from engine.errors import DataError
    batch = cfg.data.train_batch_size
    where = f"data.train_files={cfg.data.train_files!r}" if cfg.data.train_files else \
        f"data.offline_path={cfg.data.offline_path!r}" if cfg.data.offline_path else \
        f"data.builtin_task={cfg.data.builtin_task!r}"
    if len(train_data) < batch:
        filtered = sum(getattr(train_data, "filter_counts", {}).values())
        why = f" ({filtered} rows filtered out by data.truncation='filter')" if filtered else ""
        raise DataError(f"{where} has {len(train_data)} usable prompts{why}, fewer than "
                        f"data.train_batch_size={batch}; lower train_batch_size or add data")
    if val_data is not None and len(val_data) == 0:
        raise DataError(f"data.val_files={cfg.data.val_files!r} has no usable prompts; fix the files "
                        "or set data.val_files=[]")


def build(cfg, world_size, watch=None, prepared: Optional[Prepared] = None, bridge=None) -> Components:
    """Every component of a run, on this rank, from a validated config (`prepared`: what
    `prepare(cfg, world_size)` returned, computed here when not given; `bridge`: to a separate
    rollout pool)."""
    from engine.perf import peak_flops_per_rank
    from engine.rewards.manager import RewardManager
    from engine.workers.actor import ActorWorker, ReferenceWorker
    from engine.workers.critic import CriticWorker
    from parallel.mesh import init_mesh

    prepared = prepared or prepare(cfg, world_size)
    derived, tokenizer, hf_config = prepared.derived, prepared.tokenizer, prepared.hf_config
    train_data, val_data = prepared.train_data, prepared.val_data
    cfg = derived.config
    arr = cfg.actor_rollout_ref
    init_mesh(derived.layout, seed=arr.actor.megatron.seed, timeout_s=cfg.trainer.collective_timeout_s)
    steps = cfg.trainer.total_training_steps
    pad = prepared.pad_id  # every part that pads uses this one id
    response_length = arr.rollout.response_length
    # the colocated engines first, on devices training has not touched: SGLang sizes its KV pool
    # from the memory free when it starts (mem_fraction_static x that); then they give it back
    separate = cfg.trainer.rollout_pool == "separate"  # then the rollout lives on the pool's ranks
    if separate:
        _refuse_spmd_pool(cfg)
    rollout = None if separate else build_rollout(cfg, derived.rollout_topology, hf_config, tokenizer, pad_id=pad)
    if rollout is not None:
        from engine.rollout.colocated import hand_back
        hand_back(rollout)
    actor = ActorWorker(hf_config, arr.actor, arr.model, total_steps=steps, pad_token_id=pad,
                        response_length=response_length)
    critic = ref = None
    if derived.use_critic:  # its own model (critic.model.path / config; the actor's when unset)
        own = (cfg.critic.model.path, cfg.critic.model.config) != (arr.model.path, arr.model.config)
        critic_hf = (load_hf_config(cfg.critic.model, vocab_size=len(tokenizer), key="critic.model")
                     if own else hf_config)
        critic = CriticWorker(critic_hf, cfg.critic, cfg.critic.model, total_steps=steps,
                              pad_token_id=pad, response_length=response_length)
    # a LoRA actor's reference is its own base (adapters off): no second model is built
    if derived.use_reference and actor.lora is None:
        ref = ReferenceWorker(hf_config, arr.ref.megatron, arr.model, pad_token_id=pad,
                              strategy=arr.ref.strategy or "megatron")
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
    from engine.rewards import sandbox
    sandbox.configure(cfg.reward_model.sandbox)  # code rewards (and Ray reward workers) use it
    custom = None
    if cfg.custom_reward_function.path:
        from engine.rewards.custom import load_custom_reward
        custom = load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    remote = None
    if cfg.reward_model.url:  # a reward service in the rule rewards' place
        from engine.rewards.remote import RemoteReward
        remote = RemoteReward(cfg.reward_model.url, cfg.reward_model.remote)
    reward_fn = RewardManager(tokenizer, compute_score=custom, num_workers=cfg.reward_model.num_workers, remote=remote,
                              reward_manager=cfg.reward_model.reward_manager,
                              overlong=cfg.reward_model.overlong_buffer,
                              max_response_length=arr.rollout.response_length,
                              token_level=cfg.reward_model.token_level)
    reward_model = None
    if cfg.reward_model.enable:  # scores added to the rule rewards (the manager sums them)
        from engine.models.hf_io import load_hf_weights
        from engine.workers.reward_model import ImplicitRewardWorker, RewardModelWorker
        rm_config = prepared.reward_model_config
        if cfg.reward_model.token_level == "implicit":  # a DPO policy: per-token log-ratio to the reference
            reward_model = ImplicitRewardWorker(rm_config, cfg.reward_model, beta=cfg.algorithm.dpo.beta,
                                                pad_token_id=pad)
        else:
            reward_model = RewardModelWorker(rm_config, cfg.reward_model, pad_token_id=pad)
        load_hf_weights(reward_model.chunks, cfg.reward_model.model.path, hf_config=rm_config)
    from parallel import device_memory
    device_memory.track(actor, critic, ref, reward_model)  # what training holds on the device (CPU: simulated)
    checkpoints = None
    if cfg.trainer.save_freq > 0 or cfg.trainer.resume_mode != "disable":
        from engine.checkpoint import CheckpointManager
        checkpoints = CheckpointManager(cfg.trainer.default_local_dir,
                                        keep_last=cfg.trainer.max_actor_ckpt_to_keep,
                                        verify=cfg.trainer.checkpoint_verify)
    peak = peak_flops_per_rank(cfg.trainer.device, actor.params_dtype)
    return derived, Components(tokenizer, hf_config, actor, ref, critic, rollout, reward_fn,
                               train_data, val_data, checkpoints, peak, reward_model, watch, bridge, pad)


def build_rollout(cfg, topology, hf_config, tokenizer, dp_rank=None, pad_id=None, rank=None):
    """This rank's part of the rollout groups; the ranks the topology names build the engine.
    pad_id: the run's (default: engine.data.pad_token_id(tokenizer), decided here once); rank:
    this rank's in the topology (default: its torch.distributed rank)."""
    from engine.data import pad_token_id
    from megatron.core import parallel_state as ps

    from engine.rollout.group import GroupedRollout
    from engine.rollout.registry import backend_class, make_rollout, rollout_backend

    r = cfg.actor_rollout_ref.rollout
    rollout_backend(r.name, cfg.trainer.device, here=True)  # fails on every rank, before any group forms
    eos = [tokenizer.eos_token_id] + list(r.stop_token_ids)
    pad = pad_token_id(tokenizer) if pad_id is None else pad_id

    def engine(placement):
        return make_rollout(r.name, hf_config, eos, **_rollout_kwargs(cfg, hf_config, tokenizer, placement, pad))
    return GroupedRollout(topology, backend_class(r.name), engine,
                          dp_rank=ps.get_data_parallel_rank() if dp_rank is None else dp_rank, rank=rank)


def _rollout_kwargs(cfg, hf_config, tokenizer, placement, pad):
    r, arr = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref
    record = dict(record_routing=True) if arr.actor.router_replay else {}
    if r.name == "sglang":
        return dict(model_path=arr.model.path or _config_dir(hf_config, tokenizer),
                    dtype=arr.actor.megatron.params_dtype, placement=placement,
                    gpu_memory_utilization=r.gpu_memory_utilization,
                    max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs,
                    seed=r.seed, enable_deterministic_inference=r.deterministic,
                    enforce_eager=r.enforce_eager, enable_chunked_prefill=r.enable_chunked_prefill, **record)
    if r.name == "vllm":  # every rank of a group builds one with the same arguments (SPMD)
        prompt = r.prompt_length or cfg.data.max_prompt_length
        response = r.response_length or cfg.data.max_response_length
        return dict(model_path=arr.model.path or _config_dir(hf_config, tokenizer),
                    dtype=arr.actor.megatron.params_dtype, load_format="dummy",
                    tensor_model_parallel_size=placement["tp_size"],
                    gpu_memory_utilization=r.gpu_memory_utilization,
                    max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs,
                    seed=r.seed, max_model_len=prompt + response, enforce_eager=r.enforce_eager,
                    enable_chunked_prefill=r.enable_chunked_prefill, **record)
    out = dict(pad_token_id=pad, max_num_seqs=r.max_num_seqs, **record)
    if r.name == "hf":  # on the GPU in the actor's dtype
        from engine.workers.base import DTYPES
        out["dtype"] = DTYPES[arr.actor.megatron.params_dtype]
    return out


def _refuse_spmd_pool(cfg):
    """The separate pool serves from group leaders (engine/rollout/pool.py); an SPMD backend (vLLM)
    needs every rank of a group in each call, which the pool does not make yet."""
    from engine.rollout.registry import backend_class
    name = cfg.actor_rollout_ref.rollout.name
    if name != "auto" and backend_class(name).SPMD:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} with trainer.rollout_pool=separate: the "
                         "separate pool does not drive SPMD engines yet; use trainer.rollout_pool=colocated")


def _faulty(generate, incarnation):
    """`generate`, then the faults planned for phase 'pool_generate' at this call (counted from 1
    in this process) and this process's incarnation (0: the first; engine/rollout/bridge.py)."""
    from engine import faults
    calls = [0]

    def run(*args, **kwargs):
        out = generate(*args, **kwargs)
        calls[0] += 1
        faults.act("pool_generate", call=calls[0], incarnation=incarnation)
        return out
    return run


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
    from engine.experience.context import engine_generate
    from engine.rollout.pool import serve
    _refuse_spmd_pool(cfg)
    tokenizer = load_tokenizer(cfg)
    derived = derive(cfg, n_train, dataset_len=1 << 30)  # checks the layout; steps do not matter here
    if cfg.trainer.rollout_pool_max_restarts:  # the backend this machine resolved, as validation could not
        from engine.config.validate_pool import KEY, restart_refusal
        from engine.rollout.registry import rollout_backend
        why = restart_refusal(cfg, rollout_backend(cfg.actor_rollout_ref.rollout.name, cfg.trainer.device, here=True))
        if why:
            raise ValueError(f"{KEY}={cfg.trainer.rollout_pool_max_restarts}: {why}")
    hf_config = load_hf_config(cfg.actor_rollout_ref.model, vocab_size=len(tokenizer))
    group = build_rollout(derived.config, derived.rollout_topology, hf_config, tokenizer, dp_rank=0,
                          rank=bridge.rank - n_train)
    generate, r = engine_generate, derived.config.actor_rollout_ref.rollout
    if r.multi_turn.enable:  # the pool's engines run the turns; the tools run beside them
        from engine.rollout import tool_actor
        generate = tool_actor.from_config(r.multi_turn, tokenizer, r.response_length,
                                          [tokenizer.eos_token_id] + list(r.stop_token_ids), engine_generate)
    from engine import faults
    from engine.phase import set_phase
    set_phase("rollout_pool")
    if faults.ENV in os.environ:  # a pool rank killed after its n-th generation (tests)
        generate = _faulty(generate, getattr(bridge, "incarnation", 0))
    try:
        serve(bridge, group, n_train, generate=generate, partial=cfg.trainer.partial_rollout)
    finally:
        group.shutdown()


def open_pool(cfg):
    """A separate pool's bridge and worlds: (bridge, training ranks, whether this rank serves,
    its rank in its world as the seed sees it). With trainer.rollout_pool_max_restarts the
    bridge is the store's (engine/rollout/bridge.py) and each pool rank is a world of its own
    (a replacement joins no group of the dead rank's): engine.launch_ray restarts a dead one."""
    from engine.rollout.pool import Bridge, pool_ranks
    from parallel.mesh import init_distributed
    t = cfg.trainer
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    train, pool = pool_ranks(world, t.rollout_pool_ranks)
    serving = rank in pool
    if not t.rollout_pool_max_restarts:
        init_distributed(t.collective_timeout_s, ranks=pool if serving else train, name="pool" if serving else "train")
        return Bridge(rank, world, t.collective_timeout_s), train, serving, None
    from engine.errors import UsageError
    from engine.rollout.bridge import StoreBridge
    if os.environ.get("TRIDENT_LAUNCHER") != "ray":
        raise UsageError(f"trainer.rollout_pool_max_restarts={t.rollout_pool_max_restarts}: only "
                         "python -m engine.launch_ray restarts a dead pool rank (under torchrun a dead rank "
                         "ends the job); launch with engine.launch_ray, or set it to 0")
    bridge = StoreBridge(rank, world, t.collective_timeout_s, durable=serving)
    if serving:
        init_distributed(t.collective_timeout_s, ranks=range(rank, rank + 1), name=f"pool{rank}.{bridge.incarnation}")
        return bridge, train, True, rank - pool.start
    init_distributed(t.collective_timeout_s, ranks=train, name="train")
    return bridge, train, False, None


def main(argv=None):
    from engine.errors import run_main
    return run_main(_main, argv)


def _main(argv=None):
    from engine.config import load_config
    from engine.config.load import log_notes
    from engine.errors import UsageError
    from engine.phase import set_phase

    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: torchrun --nproc_per_node N -m engine.train RECIPE.yaml [key=value ...]"
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not argv:
        raise UsageError(f"no recipe given; {usage}")
    if argv[0].startswith("-"):
        raise UsageError(f"unknown option {argv[0]!r}; {usage}")
    recipe, overrides = argv[0], argv[1:]
    notes = []  # on verl's keys: logged once the recipe passes prepare (an error shows alone)
    cfg = load_config(recipe, overrides, notes=notes)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.trainer.rollout_pool == "separate":  # the training ranks' world
        world_size -= cfg.trainer.rollout_pool_ranks
    prepared = prepare(cfg, world_size)  # every check that needs no process group
    log_notes(notes)

    import torch
    import torch.distributed as dist

    from engine.trainer import Trainer, set_seed
    from parallel.mesh import init_distributed
    if not torch.cuda.is_available():
        from parallel.cpu import threads_per_process
        torch.set_num_threads(threads_per_process(os.environ, os.cpu_count()))
    from engine.guards import CollectiveWatch, is_collective_failure
    watch = CollectiveWatch().install()
    components, bridge, serving = None, None, False
    seed_rank = None
    if cfg.trainer.rollout_pool == "separate":  # two worlds: trainers, pool (engine/rollout/pool.py)
        bridge, train, serving, seed_rank = open_pool(cfg)
    else:
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    set_seed(cfg.trainer.seed + (dist.get_rank() if seed_rank is None else seed_rank))
    # the ~500k objects of the imports (torch, megatron, transformers) live as long as the run:
    # frozen, every full collection after this (return_to_device makes one per phase, ~0.3 s
    # CPU each on a CPU core) walks only what the run itself creates; the PPO trainer freezes its
    # built run again below
    from parallel.device_memory import freeze_long_lived
    freeze_long_lived()
    try:
        if serving:
            serve_pool(cfg, bridge, len(train))
        elif cfg.trainer.task != "ppo":  # reward model / DPO / SFT (engine/offline)
            from engine.offline.build import build_offline
            build_offline(cfg, dist.get_world_size()).fit()
        else:
            derived, components = build(cfg, dist.get_world_size(), watch=watch, prepared=prepared, bridge=bridge)
            trainer = Trainer(derived, components)
            freeze_long_lived()  # the hand-off's garbage collections scan only the steps' objects
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
        gc.unfreeze()  # the exit's last collection finalises native objects (nanobind reports any it misses)
    set_phase("shutdown")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
