"""What actor, critic and reference share: a Megatron model on this rank's layout, its
optimizer, and running a batch through the pipeline schedule in micro-batches.

Batches use verl's layout: `input_ids` / `attention_mask` [B, P+R] with the prompt left-padded
and the response right-padded, `responses` / `response_mask` [B, R]. The forward pass never
sees pad tokens: each sample's valid tokens are either packed back to back into one row
(`use_remove_padding`, THD) or left-aligned and right-padded per row, so attention is causal
and RoPE positions start at 0 for every sequence.

Context parallelism (CP): each CP rank feeds the model its share of every sequence
(parallel.packing's 2 x CP chunks) and computes log-probs / values at the predictions it
holds; `MegatronWorker.gather_cp` puts them back in order, so losses see whole sequences.

Tests: tests/test_ppo_update.py, tests/test_cp_workers.py, tests/test_preference_data.py
"""
import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine import faults
from engine.batch import Batch, update_split
from engine.models.builder import build_model
from engine.workers.finite import shards_finite, step_unless_nonfinite
from engine.workers.fused_adam import megatron_optimizer
from engine.workers.routing import (as_many_as_expert_peers, replay_in_backward, replay_routing,
                                    set_replay, start_replay)
from parallel import fsdp
from parallel.cpu import suspended as cpu_function_mode_suspended
from parallel.offload import Offloader, model_grads, model_params, optimizer_tensors
from parallel.packing import (cp_all_gather, cp_gather, cp_index, cp_localize, pack, round_up,
                              row_bounds)
from parallel.schedule import forward_backward, split_by_count, split_by_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MicroBatch:
    """One forward pass worth of samples, in model input form."""
    rows: List[int]               # indices into the (mini-)batch
    tokens: torch.Tensor          # [1, T] packed, or [b, S] left-aligned
    packed_params: object         # PackedSeqParams or None
    positions: torch.Tensor       # flat index into tokens.view(-1) of each response prediction
    labels: torch.Tensor          # the response token predicted at each of those positions
    response_lengths: List[int]   # per row, valid response tokens
    response_width: int           # R of the batch (response_mask.shape[1])
    last_tokens: torch.Tensor     # flat index of each row's last valid token (unsplit row)
    routing: Optional[list] = None  # per hidden layer [tokens, topk] experts to replay (router_replay)
    # context parallelism: `tokens`, `positions`, `labels` and `routing` are this CP rank's
    # share; `cp_index` places its tokens in the unsplit row and `cp_takes[r]` says which
    # predictions (in response order) CP rank r holds. None without CP.
    position_ids: Optional[torch.Tensor] = None  # [b, s] for unpacked CP batches
    cp_index: Optional[torch.Tensor] = None
    cp_takes: Optional[List[torch.Tensor]] = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_last_tokens: Optional[torch.Tensor] = None  # local places of the last tokens it holds
    cp_last_takes: Optional[List[torch.Tensor]] = None  # which rows' last token rank r holds

    def own_predictions(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-prediction values of the whole micro-batch -> those this CP rank holds."""
        return flat if self.cp_takes is None else flat[self.cp_takes[self.cp_rank]]

    def _valid(self, device):
        lengths = torch.tensor(self.response_lengths, device=device)
        return torch.arange(self.response_width, device=device)[None, :] < lengths[:, None]

    def to_padded(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-prediction values [n] -> [rows, R] right-padded with zeros (differentiable)."""
        return flat.new_zeros(len(self.rows), self.response_width).masked_scatter(
            self._valid(flat.device), flat)

    def to_flat(self, padded: torch.Tensor) -> torch.Tensor:
        """[rows, R] -> per-prediction values [n], the inverse of `to_padded`."""
        return padded[self._valid(padded.device)]

    def to(self, device) -> "MicroBatch":
        """The model's inputs on `device` (micro-batches are built on the CPU)."""
        params = self.packed_params
        if params is not None:
            params = dataclasses.replace(params, **{
                f.name: getattr(params, f.name).to(device) for f in dataclasses.fields(params)
                if isinstance(getattr(params, f.name), torch.Tensor)})
        moved = lambda t: None if t is None else t.to(device)  # noqa: E731
        return dataclasses.replace(
            self, tokens=self.tokens.to(device), packed_params=params,
            positions=self.positions.to(device), labels=self.labels.to(device),
            last_tokens=self.last_tokens.to(device), position_ids=moved(self.position_ids),
            routing=None if self.routing is None else [r.to(device) for r in self.routing],
            cp_takes=None if self.cp_takes is None else [t.to(device) for t in self.cp_takes],
            cp_last_tokens=moved(self.cp_last_tokens),
            cp_last_takes=None if self.cp_last_takes is None else [
                t.to(device) for t in self.cp_last_takes])


def sample_sequences(batch: Batch):
    """(valid token ids, prompt length, response length) of each sample (a multi-turn
    response_mask leaves out observations): one masked gather, as it runs for every micro-batch."""
    input_ids, attn, responses = batch["input_ids"], batch["attention_mask"].bool(), batch["responses"]
    prompt_width = attn.shape[1] - responses.shape[1]
    prompt_attn, resp_len = attn[:, :prompt_width], attn[:, prompt_width:].sum(-1)
    in_response = torch.arange(responses.shape[1], device=attn.device) < resp_len[:, None]
    keep = torch.cat([prompt_attn, in_response], 1)
    flat = torch.cat([input_ids[:, :prompt_width], responses], 1)[keep]
    prompt_len = prompt_attn.sum(-1)
    seqs = flat.split((prompt_len + resp_len).tolist())
    return list(zip(seqs, prompt_len.tolist(), resp_len.tolist()))


def make_micro_batch(batch: Batch, rows: List[int], *, packed: bool, multiple_of: int,
                     pad_id: int = 0, min_length: int = 0, cp_size: int = 1,
                     cp_rank: Optional[int] = 0) -> MicroBatch:
    """The model inputs of `rows`. With cp_size > 1, every sequence (packed) or row (unpacked)
    is padded to a multiple of 2 x CP x `multiple_of` and the micro-batch holds CP rank
    `cp_rank`'s share; cp_rank=None gives the padded row unsplit (what the shares come from)."""
    seqs = sample_sequences(batch.select(["input_ids", "attention_mask", "responses"]).index_select(rows))
    width = batch["responses"].shape[1]
    seq_multiple = 2 * cp_size * multiple_of if cp_size > 1 else 1
    if packed:
        p = pack([s for s, _, _ in seqs], pad_id=pad_id, multiple_of=multiple_of,
                 min_length=min_length, seq_multiple_of=seq_multiple)
        tokens, params, starts, bounds = p.tokens, p.params, p.offsets, p.bounds
    else:
        longest = max(max(s.numel() for s, _, _ in seqs), min_length)
        longest = round_up(longest, max(multiple_of, seq_multiple))
        tokens = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
        for r, (s, _, _) in enumerate(seqs):
            tokens[r, : s.numel()] = s
        params, starts = None, [r * longest for r in range(len(seqs))]
        bounds = row_bounds(len(seqs), longest)
    # token t+1 is predicted at position t: sequence i's response from start_i + plen_i - 1 on
    plens, rlens = (torch.tensor([s[i] for s in seqs]) for i in (1, 2))
    first = torch.tensor(starts) + plens - 1
    done = torch.cumsum(rlens, 0) - rlens  # response tokens of the sequences before
    positions = torch.repeat_interleave(first - done, rlens) + torch.arange(int(rlens.sum()))
    labels = torch.cat([seq[plen: plen + rlen] for seq, plen, rlen in seqs])
    last = first + rlens
    index = position_ids = takes = last_local = last_takes = None
    unsplit_shape = tuple(tokens.shape)
    if cp_size > 1 and cp_rank is not None:
        index = cp_index(bounds, cp_size, cp_rank)
        takes = [cp_localize(positions, cp_index(bounds, cp_size, r))[1] for r in range(cp_size)]
        last_takes = [cp_localize(last, cp_index(bounds, cp_size, r))[1] for r in range(cp_size)]
        last_local = cp_localize(last, index)[0]
        positions, mine = cp_localize(positions, index)
        labels = labels[mine]
        if not packed:  # RoPE of a [b, s] batch reads position ids; THD reads cu_seqlens
            position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0])[index]
            position_ids = position_ids.view(tokens.shape[0], -1)
        tokens = tokens.reshape(-1)[index].view(tokens.shape[0], -1)
    routing = None
    if "routed_experts" in batch:
        routing = replay_routing(batch, rows, starts, seqs, unsplit_shape, index)
    return MicroBatch(rows=list(rows), tokens=tokens, packed_params=params,
                      positions=positions, labels=labels,
                      response_lengths=[r for _, _, r in seqs], response_width=width,
                      last_tokens=last, routing=routing, position_ids=position_ids,
                      cp_index=index, cp_takes=takes, cp_size=cp_size if takes else 1,
                      cp_rank=cp_rank if takes else 0, cp_last_tokens=last_local,
                      cp_last_takes=last_takes)


class MegatronWorker:
    """A model (actor, critic or reference) on this rank's Megatron layout."""

    name = "model"  # metric prefix and fault-injection name
    split = None  # (micro_batch_size, max_tokens) an out-of-memory settled on; None: the plan's

    # whether this worker's heads gather their CP shares (`gather_cp`); others refuse CP > 1
    supports_context_parallel = False

    def __init__(self, hf_config, *, megatron_cfg, model_cfg, head="lm", optim_cfg=None,
                 total_steps=1, pad_token_id=0, router_replay=False, lora=None,
                 strategy="megatron"):
        if ps.get_context_parallel_world_size() > 1 and not self.supports_context_parallel:
            raise ValueError(f"{type(self).__name__} does not support context parallelism yet; "
                             "set its megatron.context_parallel_size=1")
        self.hf_config = hf_config
        self.megatron_cfg = megatron_cfg
        self.model_cfg = model_cfg
        self.pad_token_id = pad_token_id
        self.params_dtype = DTYPES[megatron_cfg.params_dtype]
        if megatron_cfg.tp_comm_overlap:
            raise ValueError("megatron.tp_comm_overlap=true needs TransformerEngine userbuffers, which "
                             "Trident does not initialise yet; set tp_comm_overlap=false")
        recompute = {}
        if megatron_cfg.recompute_granularity or model_cfg.enable_gradient_checkpointing:
            recompute = dict(recompute_granularity=megatron_cfg.recompute_granularity or "full")
            if recompute["recompute_granularity"] == "full":  # Megatron refuses both for selective
                recompute.update(recompute_method=megatron_cfg.recompute_method or "uniform",
                                 recompute_num_layers=megatron_cfg.recompute_num_layers or 1)
        self.router_replay = router_replay
        overrides = {"moe_enable_routing_replay": True} if router_replay else None
        self.chunks = build_model(hf_config, head=head, params_dtype=self.params_dtype, lora=lora,
                                  sequence_parallel=bool(megatron_cfg.sequence_parallel),
                                  config_overrides=overrides, fusions=megatron_cfg.fusions,
                                  ddp_grads=optim_cfg is not None and strategy == "megatron", **recompute)
        self.config = self.chunks[0].config
        self.optimizer = self.scheduler = None
        held = ("params", "grads", "optimizer") if optim_cfg is not None else ("params",)  # ref: params
        self._offloaders = {s: Offloader() for s in held}
        self.sharded = strategy != "megatron"  # parallel/fsdp.py: parameters sharded over DP
        if self.sharded:
            fsdp.check_layout(lora)
            self.chunks = [fsdp.wrap(c, reshard_after_forward=megatron_cfg.reshard_after_forward,
                                     forward_prefetch=megatron_cfg.forward_prefetch)
                           for c in self.chunks]
        if optim_cfg is not None:
            self._setup_training(optim_cfg, total_steps)
        for model in self.models:
            model.return_hidden = head == "lm"

    # -- structure -------------------------------------------------------------------------
    @property
    def models(self):
        """The unwrapped TridentGPTModel of each chunk."""
        return [getattr(c, "module", c) for c in self.chunks]

    @property
    def device(self):
        """Where the model and its inputs live: this rank's GPU, or the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_last_stage(self):
        return ps.is_pipeline_last_stage()

    def _setup_training(self, optim_cfg, total_steps):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        m = self.megatron_cfg
        # FSDP shards the optimizer state with the parameters: Megatron's plain optimizer on them
        distributed = m.use_distributed_optimizer and not self.sharded
        if not self.sharded:
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=m.overlap_grad_reduce,
                overlap_param_gather=m.overlap_param_gather and distributed,
                use_distributed_optimizer=distributed)
            self.chunks = [DistributedDataParallel(c.config, ddp_cfg, c,
                                                   disable_bucketing=i > 0)
                           for i, c in enumerate(self.chunks)]
            for chunk in self.chunks:
                # DP replicas must start identical (CPU init draws from each rank's own generator)
                chunk.broadcast_params()
        # How Megatron's schedules drive DDP: gradients sync once per mini-batch (after the last
        # micro-batch), and with overlap_grad_reduce bucket by bucket during that backward.
        one = len(self.chunks) == 1
        config = self.chunks[0].config
        config.no_sync_func = self.chunks[0].no_sync if one else [c.no_sync for c in self.chunks]
        if m.overlap_grad_reduce:
            config.grad_sync_func = (self.chunks[0].start_grad_sync if one
                                     else [c.start_grad_sync for c in self.chunks])
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
            weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.betas[0],
            adam_beta2=optim_cfg.betas[1], adam_eps=optim_cfg.eps, clip_grad=optim_cfg.clip_grad,
            use_distributed_optimizer=distributed,
            bf16=self.params_dtype == torch.bfloat16, fp16=self.params_dtype == torch.float16,
            params_dtype=self.params_dtype,
            overlap_param_gather=m.overlap_param_gather and distributed)
        self.optimizer = megatron_optimizer(opt_cfg, self.chunks)
        warmup = optim_cfg.lr_warmup_steps
        if warmup is None or warmup < 0:
            warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
        total_steps = max(total_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup > 0 else optim_cfg.lr, max_lr=optim_cfg.lr,
            min_lr=optim_cfg.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=max(total_steps, warmup + 1),
            lr_decay_style=optim_cfg.lr_decay_style, start_wd=optim_cfg.weight_decay,
            end_wd=optim_cfg.weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant")

    # -- micro-batching --------------------------------------------------------------------
    def micro_groups(self, batch: Batch, micro_batch_size=None, max_tokens=None, rows=None):
        """Row indices of each micro-batch: `micro_batch_size` rows, or up to `max_tokens`."""
        rows = list(range(len(batch))) if rows is None else list(rows)
        if max_tokens is not None:
            lengths = batch["attention_mask"][rows].sum(-1).tolist()
            return as_many_as_expert_peers([[rows[i] for i in g] for g in split_by_tokens(lengths, max_tokens)])
        return [[rows[i] for i in g] for g in split_by_count(len(rows), micro_batch_size)]

    def micro_batches(self, batch: Batch, *, micro_batch_size=None, max_tokens=None,
                      rows: Optional[List[int]] = None,
                      groups: Optional[List[List[int]]] = None) -> List[MicroBatch]:
        """`groups`: the rows of each micro-batch, given (e.g. whole preference pairs), instead
        of a split by count or tokens."""
        if groups is None:
            groups = self.micro_groups(batch, micro_batch_size, max_tokens, rows)
        packed = bool(self.model_cfg.use_remove_padding)
        multiple = ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1
        cp = ps.get_context_parallel_world_size()
        min_length = 0
        if not self.config.variable_seq_lengths:
            # every micro-batch of one schedule call must have the same shape (under CP, each
            # sequence is padded to a multiple of 2 x CP x `multiple` before packing)
            span = 2 * cp * multiple if cp > 1 else 1
            lengths = [round_up(int(n), span) for n in batch["attention_mask"].sum(-1)]
            min_length = max(sum(lengths[i] for i in g) if packed else max(lengths[i] for i in g)
                             for g in groups)
            if ps.get_expert_model_parallel_world_size() > 1:
                # the allgather dispatcher gathers tokens over EP peers (other DP ranks), which
                # must hold as many: every data-parallel rank pads to the longest
                longest = torch.tensor([min_length])
                dist.all_reduce(longest, op=dist.ReduceOp.MAX,
                                group=ps.get_data_parallel_group(with_context_parallel=True))
                min_length = int(longest)
        cp_rank = ps.get_context_parallel_rank()
        with cpu_function_mode_suspended():  # host tensors only, no Megatron code
            return [make_micro_batch(batch, g, packed=packed, multiple_of=multiple, pad_id=self.pad_token_id,
                                     min_length=min_length, cp_size=cp, cp_rank=cp_rank) for g in groups]

    def last_token_values(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The model output at each row's last valid token [rows] (a reward model's score), with
        or without CP. (RewardModelWorker can use it and then set supports_context_parallel.)"""
        if mb.cp_last_takes is None:
            return output.reshape(-1)[mb.last_tokens]
        return self.gather_cp(output.reshape(-1)[mb.cp_last_tokens], mb, mb.cp_last_takes)

    def gather_cp(self, values: torch.Tensor, mb: MicroBatch, takes=None) -> torch.Tensor:
        """This CP rank's per-prediction values -> every prediction of the micro-batch, in order
        (`takes`: which entries each rank holds, when not the predictions, `mb.cp_takes`).

        Losses then run on whole sequences, identically on every CP rank (sequence-level terms
        such as GSPO's ratio or seq-mean aggregation need all of a sequence's tokens). Loss
        invariant: the gradient of the gathered values flows back to its owner only, so each CP
        rank back-propagates dL/d(its own tokens) and Megatron's gradient all-reduce, a sum over
        DP x CP, adds the ranks' shares into dL/dw exactly once (calculate_per_token_loss: no
        averaging; the LossNormaliser counts are summed over DP only, CP ranks share the data).
        """
        takes = mb.cp_takes if takes is None else takes
        if takes is None:
            return values
        parts = cp_all_gather(values, [t.numel() for t in takes], ps.get_context_parallel_group())
        return cp_gather(parts, takes)

    def run(self, micro: List[MicroBatch], head_fn: Callable, *, forward_only: bool,
            agree_on_oom: bool = False):
        """Run micro-batches through the pipeline. `head_fn(output, mb)` gets the last stage's
        output (hidden states [b, s, h] or values [b, s]) and returns (loss, info)."""

        device = self.device
        index = iter(range(len(micro) * len(self.chunks)))
        if self.router_replay:
            start_replay(self.chunks)

        # an update that may retry: the stage's peers agree on an out-of-memory before each
        # micro-batch and idle together (engine/workers/oom.py)
        from engine.workers.oom import OOMAgreement
        oom = OOMAgreement(self) if agree_on_oom and not forward_only else None

        def step(model, mb: MicroBatch):
            at = next(index)
            if oom is not None and oom.idles(at):
                return oom.idle_step(model, mb)
            if not forward_only and faults.fault("oom", model=self.name, micro=at):
                raise faults.SimulatedOOM(f"injected out of memory in micro-batch {at}")
            mb = mb.to(device)
            if self.router_replay:  # engine/workers/routing.py
                set_replay(model, mb.routing, self.config.sequence_parallel)
            position_ids = mb.position_ids
            if position_ids is None and mb.packed_params is None:
                position_ids = torch.arange(mb.tokens.shape[1], device=device).expand_as(mb.tokens)
            # on the CPU, without parallel.cpu's function mode (a Python call per op): the
            # model's forward and the heads (log-prob kernels, losses) name no CUDA device; the
            # schedule around them does
            with cpu_function_mode_suspended():
                out = model(mb.tokens, position_ids, None, packed_seq_params=mb.packed_params)
            if self.router_replay:
                replay_in_backward(model)

            def loss_fn(output):
                with cpu_function_mode_suspended():
                    loss, info = head_fn(output, mb)
                return loss, torch.tensor(1), info
            return out, loss_fn

        # the schedule divides by CP (and TP under SP) for its p2p shapes: the unsplit length
        seq_length = max(mb.tokens.shape[1] * mb.cp_size for mb in micro)
        return forward_backward(self.chunks, micro, step, forward_only=forward_only, seq_length=seq_length,
                                micro_batch_size=micro[0].tokens.shape[0], agree_on_oom=agree_on_oom,
                                recorded_oom=oom.recorded if oom is not None else None)

    # -- colocation ------------------------------------------------------------------------
    def state_tensors(self, state):
        """The tensors of one state: 'params', 'grads' (Megatron's buffers) or 'optimizer'."""
        if state == "params":
            return model_params(self.chunks)
        if state == "grads":
            return model_grads(self.chunks)
        return optimizer_tensors(self.optimizer) if self.optimizer is not None else []

    def set_resident(self, states):
        """Keep exactly `states` on the device (engine/config/phases.py decides which): the
        others' storage is copied to the host and freed, and comes back when asked for. Storage
        the optimizer shares with the parameters (fp32 main params) moves with the parameters."""
        params = None  # read only when something leaves (this runs at every phase change)
        for state, offloader in self._offloaders.items():
            if state in states and offloader.offloaded:
                offloader.reload()
            elif state not in states and not offloader.offloaded:
                params = model_params(self.chunks) if params is None else params
                offloader.offload(self.state_tensors(state), keep=[] if state == "params" else params)

    def resident_bytes(self):
        """{state: bytes on the device now}, each storage counted once; storage the optimizer
        shares with the parameters counts as parameters."""
        out, taken = {}, set()
        for state in ("params", "grads", "optimizer"):
            seen = {}
            for t in self.state_tensors(state):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in taken:
                    seen[key or id(t)] = storage.nbytes()
            out[state] = sum(seen.values())
            taken |= {k for k in seen if k}
        return out

    def broadcast_from_last_stage(self, tensor: Optional[torch.Tensor], shape, dtype=torch.float32):
        """Forward-only results live on the last pipeline stage; every stage needs them."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype)  # CPU: the gloo half of the process group
        dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return tensor

    # -- optimisation ----------------------------------------------------------------------
    def start_update(self, micro_batch_size=None, max_tokens=None):
        """Training mode, and the micro-batch split: given, or by tokens (`use_dynamic_bsz`),
        or by `ppo_micro_batch_size_per_gpu` from this model's config section."""
        for c in self.chunks:
            c.train()
        if micro_batch_size is None and max_tokens is None:  # the derived plan's rule
            split = update_split(self.cfg)
            micro_batch_size, max_tokens = split.micro_batch_size, split.max_tokens
        return micro_batch_size, max_tokens

    def zero_grad(self):
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def free_memory(self):
        """After an out-of-memory: drop what the failed attempt left, give the cache back."""
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def log(self, message):
        if dist.get_rank() == 0:
            print(f"{self.name}: {message}", flush=True)

    def optimizer_step(self):
        """One optimizer step on the accumulated gradients; (grad_norm, lr, applied). NaN / Inf
        anywhere in the gradients (any rank) skips it on every rank together: nothing is
        applied, the LR schedule does not advance."""
        lr = self.optimizer.param_groups[0]["lr"]
        if not self.sharded:
            success, grad_norm = step_unless_nonfinite(self.optimizer)
        elif shards_finite(self.chunks):  # FSDP: every shard checked, then its own step
            success, grad_norm, _ = self.optimizer.step()
        else:
            success = False
        if not success:
            self.zero_grad()
            return float("nan"), lr, False
        if self.megatron_cfg.overlap_param_gather and self.megatron_cfg.use_distributed_optimizer:
            # overlapped gathering would defer the updated parameters to the next forward's
            # hooks; the rollout engine reads them before that, so gather them now
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)
        if success:
            self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        return (float(grad_norm) if grad_norm is not None else float("nan")), lr, success

    def dp_all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        return values


def global_counts(normaliser, group):
    """Sum a LossNormaliser's counts over the data-parallel group."""
    t = torch.tensor([normaliser.global_token_count, normaliser.global_seq_count],
                     dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return type(normaliser)(float(t[0]), float(t[1]), normaliser.max_response_len)
