"""CPU rollout: a transformers model fed by streamed HF-named tensors, batched decoding
with a KV cache. Same interface as the SGLang backend; meant for tests and the CPU demo.

The model is built from its config with every parameter on the meta device (buffers such
as RoPE frequencies are computed for real), so building costs no weight memory. Storage
for the weights is allocated once per resume and weights are copied into it, so the
process holds exactly one copy of them.

Tests: tests/test_rollout_cpu.py, tests/test_partial_rollouts.py, tests/test_reshard.py, tests/test_router_replay.py,
tests/test_device_stack.py
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from engine.rollout.base import (FINISH_LENGTH, FINISH_STOP, RolloutEngine, RolloutOutput,
                                 SamplingParams, register_rollout)
from engine.rollout.kv_cache import LeanCache, cache_argument, distinct_rows, preallocated_cache
from engine.rollout.lean_decode import LeanForward, unsupported
from parallel.cpu import suspended


@contextlib.contextmanager
def _parameters_on_meta():
    """Create parameters on the meta device while buffers stay real (not thread-safe)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@dataclass
class _Slot:
    """Where one checkpoint tensor lands: ``param_name[index]`` with ``shape``."""
    param_name: str
    index: tuple
    shape: torch.Size


# transformers 5 fuses MoE experts into 3-D parameters (experts.gate_up_proj [E, 2I, H],
# experts.down_proj [E, H, I]); checkpoints and SGLang name them per expert. Mixtral-style
# checkpoints use block_sparse_moe / w1 (gate), w3 (up), w2 (down).
_PER_EXPERT_NAMES = {"default": ("mlp", "gate_proj", "up_proj", "down_proj"),
                     "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_MIXTRAL_LIKE = ("mixtral", "minimax")


def _checkpoint_slots(model_type: str, param_name: str, shape: torch.Size) -> list[tuple[str, _Slot]]:
    """Checkpoint names that fill ``param_name`` and the slice each one fills."""
    style = "mixtral" if model_type in _MIXTRAL_LIKE else "default"
    moe, gate, up, down = _PER_EXPERT_NAMES[style]
    fused = re.fullmatch(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)", param_name)
    if fused is None or len(shape) != 3:
        name = param_name.replace(".mlp.", f".{moe}.") if style == "mixtral" else param_name
        return [(name, _Slot(param_name, (), shape))]
    prefix, kind = fused.groups()
    slots = []
    for e in range(shape[0]):
        base = f"{prefix}.{moe}.experts.{e}"
        if kind == "down_proj":
            slots.append((f"{base}.{down}.weight", _Slot(param_name, (e,), shape[1:])))
        else:
            half = shape[1] // 2
            slots.append((f"{base}.{gate}.weight", _Slot(param_name, (e, slice(0, half)), torch.Size([half, shape[2]]))))
            slots.append((f"{base}.{up}.weight", _Slot(param_name, (e, slice(half, 2 * half)), torch.Size([half, shape[2]]))))
    return slots


def _row_uniforms(sampling: SamplingParams, rows: list) -> torch.Tensor:
    """[rows, max_new_tokens] uniforms; row (prompt key k, sample j) draws from its own stream
    seeded by (seed, k, j), so the same prompt samples the same way in any batch (and a row
    resumed from its prefix reads on from where it paused)."""
    base = sampling.seed if sampling.seed is not None else int(torch.seed())
    out = torch.empty(len(rows), sampling.max_new_tokens, dtype=torch.float64)
    generator = torch.Generator()
    for r, (key, j) in enumerate(rows):
        generator.manual_seed(hash((base, int(key), j)) & ((1 << 63) - 1))
        torch.rand(sampling.max_new_tokens, generator=generator, dtype=torch.float64, out=out[r])
    return out


@register_rollout("cpu")
class CPURollout(RolloutEngine):
    """Rollout on CPU with a transformers causal LM built from ``hf_config``.

    ``eos_token_ids`` end a response (plus ``SamplingParams.stop_token_ids``);
    ``record_routing=True`` records MoE routing (see :class:`RolloutOutput`).
    """
    LOADS_SLICES = True  # one process plays every TP rank of its group: any slice lands in place

    def __init__(self, hf_config, eos_token_ids: Sequence[int] = (), pad_token_id: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, record_routing: bool = False, max_num_seqs: int = 1 << 30,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        if max_num_seqs < 1:
            raise ValueError(f"actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}: must be >= 1 "
                             f"(sequences decoded at once)")
        self.dtype, self.device, self.max_num_seqs = dtype, torch.device(device), max_num_seqs
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # any valid id works: pads are masked out of attention and never returned
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else
                                (self.eos_token_ids[0] if self.eos_token_ids else 0))
        with _parameters_on_meta():
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        self.model.eval().requires_grad_(False)
        if self.device.type != "cpu":  # buffers (RoPE frequencies) were built on the CPU
            for module in self.model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)

        # every (module, attribute) holding each parameter; tied weights share one entry
        self._owners: dict[str, list[tuple[nn.Module, str]]] = {}
        aliases: dict[str, list[str]] = {}
        canonical: dict[int, str] = {}
        for module_name, module in self.model.named_modules():
            for attr, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{attr}" if module_name else attr
                key = canonical.setdefault(id(param), full)
                self._owners.setdefault(key, []).append((module, attr))
                aliases.setdefault(key, []).append(full)
        model_type = getattr(hf_config, "model_type", "")
        self._slots: dict[str, _Slot] = {}
        for key, names in aliases.items():
            shape = self._param(key).shape
            for alias in names:
                for ckpt_name, slot in _checkpoint_slots(model_type, alias, shape):
                    slot.param_name = key  # a tied alias writes the canonical parameter
                    self._slots[ckpt_name] = slot
        self._slot_ids = {name: (slot.param_name, repr(slot.index)) for name, slot in self._slots.items()}
        self._missing: set = set(self._slot_ids.values())
        self._filled: dict = {}  # elements loaded per slot by load_slices in this sync
        self._allocated = False
        self._weights_ready = False

        self.record_routing = record_routing
        self._routers = self._find_routers() if record_routing else {}
        # dense Llama-family models decode through the same modules without transformers'
        # per-token plumbing (engine/rollout/lean_decode.py); None: transformers' forward
        # (routing capture hooks MoE routers: MoE models keep transformers' forward)
        self.lean_forward = LeanForward(self.model) if unsupported(self.model) is None else None

    # ----------------------------------------------------------------- weights
    def checkpoint_names(self) -> list[str]:
        """Every name ``update_weights`` accepts (tied weights under both names)."""
        return list(self._slots)

    def _param(self, key: str) -> nn.Parameter:
        module, attr = self._owners[key][0]
        return getattr(module, attr)

    def _set_storage(self, device: str):
        for key, owners in self._owners.items():
            old = self._param(key)
            new = nn.Parameter(torch.empty(old.shape, dtype=self.dtype, device=device), requires_grad=False)
            for owner, owner_attr in owners:
                setattr(owner, owner_attr, new)

    @suspended()  # no Megatron code here (parallel/cpu.py suspended)
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._allocated:
            self.resume_memory()
        if self._weights_ready:  # first bucket of a new sync
            self._weights_ready = False
            self._missing = set(self._slot_ids.values())
            self._filled = {}
        for name, tensor in named_tensors:
            slot = self._slots.get(name)
            if slot is None:
                raise ValueError(f"update_weights: unknown weight name {name!r} for {type(self.model).__name__}; "
                                 f"expected HF checkpoint names such as {list(self._slots)[:3]} "
                                 f"(CPURollout.checkpoint_names() lists them all)")
            if tuple(tensor.shape) != tuple(slot.shape):
                raise ValueError(f"update_weights: weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(slot.shape)} from the model config")
            self._param(slot.param_name).data[slot.index].copy_(tensor)
            self._missing.discard(self._slot_ids[name])

    @suspended()  # no Megatron code here (parallel/cpu.py suspended)
    def load_slices(self, pieces) -> None:
        """[(HF name, box, tensor)] into the weights (the transfer plan's delivery); a weight
        counts as sent once its slices cover it (the caller sends each element once)."""
        if not self._allocated:
            self.resume_memory()
        if self._weights_ready:
            self._weights_ready = False
            self._missing = set(self._slot_ids.values())
            self._filled = {}
        for name, box, tensor in pieces:
            slot = self._slots.get(name)
            if slot is None:
                raise ValueError(f"load_slices: unknown weight name {name!r} for {type(self.model).__name__}")
            if len(box) != len(slot.shape) or any(not 0 <= lo < hi <= n for (lo, hi), n in zip(box, slot.shape)):
                raise ValueError(f"load_slices: box {box} of {name!r} is outside its shape {tuple(slot.shape)}")
            target = self._param(slot.param_name).data[slot.index]
            target[tuple(slice(lo, hi) for lo, hi in box)].copy_(tensor)
            sid = self._slot_ids[name]
            self._filled[sid] = self._filled.get(sid, 0) + tensor.numel()
            if self._filled[sid] >= slot.shape.numel():
                self._missing.discard(sid)

    def weight(self, name: str) -> torch.Tensor:
        """The loaded weight under its HF checkpoint name (a view; for tests and checks)."""
        slot = self._slots[name]
        return self._param(slot.param_name).data[slot.index]

    def finish_weight_update(self) -> None:
        if self._missing:
            names = sorted(n for n, sid in self._slot_ids.items() if sid in self._missing)
            raise ValueError(f"finish_weight_update: {len(names)} weight(s) were never sent, e.g. {names[:5]}; "
                             f"send every weight (tied lm_head / embed_tokens under either name) before finishing")
        self._weights_ready = True

    @suspended()  # no Megatron code here (parallel/cpu.py suspended)
    def release_memory(self, tags=None) -> None:
        """The weights' storage goes back to this process's allocator, where the training
        phases take it (parallel/cpu.py keeps freed memory mapped, as torch's CUDA caching
        allocator keeps freed blocks); the next resume takes pages training already touched.
        Handing it to the OS instead (a process-wide malloc_trim) made every phase after it
        fault its memory in again: training's activations, then the weights."""
        if tags is not None and "weights" not in tags:
            return  # the KV cache lives only inside generate()
        self._set_storage("meta")
        self._allocated = False
        self._weights_ready = False
        self._missing = set(self._slot_ids.values())
        self._filled = {}

    @suspended()  # no Megatron code here (parallel/cpu.py suspended)
    def resume_memory(self, tags=None) -> None:
        if not self._allocated and (tags is None or "weights" in tags):
            self._set_storage(self.device)
            self._allocated = True

    # ----------------------------------------------------------------- routing
    def _find_routers(self) -> dict[int, nn.Module]:
        """{decoder layer index: its router}. transformers 5 routers (Qwen2-MoE, Qwen3-MoE,
        Mixtral, ...) are *TopKRouter modules returning (logits, weights, expert indices)."""
        routers = {}
        for name, module in self.model.named_modules():
            if type(module).__name__.lower().endswith("topkrouter"):
                found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
                if found is None:
                    raise ValueError(f"record_routing: router {name!r} is not inside a decoder layer (layers.<i>)")
                routers[int(found.group(1))] = module
        if not routers:
            raise ValueError(f"record_routing=True needs a MoE model with top-k router modules; "
                             f"{type(self.model).__name__} has none: set record_routing=False")
        return routers

    @contextlib.contextmanager
    def _recording(self, steps: list):
        """Hook the routers; each ``record(rows, seq)`` call appends the experts chosen in the
        last forward to ``steps`` as one [rows, seq, num_hidden_layers, top_k] int32 tensor.
        Like SGLang's capture buffer (sglang/srt/state_capturer/routed_experts.py: one row per
        hidden layer, written by MoE layers at their layer id), dense layers' rows stay 0."""
        per_layer: dict[int, torch.Tensor] = {}
        layers = int(self.model.config.num_hidden_layers)

        def hook(layer, module, args, output):
            if not (isinstance(output, tuple) and not output[-1].is_floating_point()):
                raise ValueError(f"record_routing: {type(module).__name__} does not return expert indices last")
            per_layer[layer] = output[-1]

        def record(rows: int, seq: int):
            top_k = next(iter(per_layer.values())).shape[-1]
            out = torch.zeros(rows, seq, layers, top_k, dtype=torch.int32)
            for layer, chosen in per_layer.items():
                out[:, :, layer] = chosen.reshape(rows, seq, top_k).to(device="cpu", dtype=torch.int32)
            steps.append(out)
            per_layer.clear()

        handles = [r.register_forward_hook(lambda m, a, o, i=i: hook(i, m, a, o)) for i, r in self._routers.items()]
        try:
            yield record
        finally:
            for h in handles:
                h.remove()

    # -------------------------------------------------------------- generation
    def _forward(self, input_ids, attention_mask, position_ids, cache):
        if isinstance(cache, LeanCache):
            return self.lean_forward(input_ids, attention_mask, position_ids, cache)
        # the cache under the name this transformers takes: an unknown name lands in **kwargs and
        # is ignored, and every decoded token would then be read without its context
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **{cache_argument(type(self.model)): cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    @staticmethod
    def _filtered(scaled: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Top-k then top-p filtering of temperature-scaled logits (-inf outside)."""
        if sampling.top_k != -1 and sampling.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens before it already reach top_p (the first always stays)
            drop = probs.cumsum(-1) - probs >= sampling.top_p
            scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return scaled

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: Optional[Sequence[int]] = None, should_pause=None) -> RolloutOutput:
        """Decodes at most `max_num_seqs` sequences at once (prompts x n); each row's sampling
        depends only on its prompt's key, so the split does not change the responses.
        `should_pause()` (partial rollouts: engine/rollout/partial.py), asked after every decoded
        token, stops the decoding there when it answers True: the rows not finished come back
        with finish reason FINISH_PAUSED and the tokens they have; `continue_generation` goes on."""
        keys = list(range(len(prompt_ids))) if keys is None else list(keys)
        specs = [(list(p), key, j, []) for p, key in zip(prompt_ids, keys) for j in range(sampling.n)]
        return self._run(specs, sampling, should_pause)

    def continue_generation(self, prompt_ids, sampling: SamplingParams, keys, partial: RolloutOutput,
                            should_pause=None) -> RolloutOutput:
        """Go on with `partial` (a paused generate's output, maybe with new weights loaded since):
        every paused row continues from its prompt + the tokens it has (its prefix, prefilled
        with the weights now loaded), its sampling reading on where it stopped, up to
        max_new_tokens in all; rows that had finished stay. Same answer shape as generate."""
        from engine.rollout.partial import merge_continued, paused_rows
        keys = list(range(len(prompt_ids))) if keys is None else list(keys)
        rows = paused_rows(partial)
        specs = [(list(prompt_ids[r // sampling.n]), keys[r // sampling.n], r % sampling.n,
                  list(partial.responses[r])) for r in rows]
        return merge_continued(partial, rows, self._run(specs, sampling, should_pause) if rows else None)

    def _run(self, specs, sampling, should_pause):
        """Rows of (prompt, key, sample index, prefix) in parts of at most max_num_seqs prompts x n;
        a pause leaves the parts not started paused with no tokens."""
        from engine.rollout.partial import FINISH_PAUSED
        per = max(1, self.max_num_seqs // sampling.n) * sampling.n
        if len(specs) <= per:
            return self._generate(specs, sampling, should_pause)
        parts = []
        for i in range(0, len(specs), per):
            part = specs[i:i + per]
            if parts and FINISH_PAUSED in parts[-1].finish_reasons:
                parts.append(RolloutOutput([], [[] for _ in part], [[] for _ in part], [FINISH_PAUSED] * len(part)))
            else:
                parts.append(self._generate(part, sampling, should_pause))
        return RolloutOutput(
            prompt_index=[r // sampling.n for r in range(len(specs))],
            responses=[r for p in parts for r in p.responses], log_probs=[x for p in parts for x in p.log_probs],
            finish_reasons=[f for p in parts for f in p.finish_reasons],
            routed_experts=None if parts[0].routed_experts is None else
            [x for p in parts for x in p.routed_experts])

    @torch.no_grad()
    def _generate(self, specs, sampling: SamplingParams, should_pause=None) -> RolloutOutput:
        from engine.rollout.partial import FINISH_PAUSED
        if not self._weights_ready:
            raise RuntimeError("CPURollout.generate: no weights loaded; call update_weights(...) for every "
                               "bucket and then finish_weight_update() (again after each resume_memory())")
        if not specs or any(len(s[0]) == 0 for s in specs):
            raise ValueError("generate: prompt_ids must be a non-empty list of non-empty token id lists")
        offsets = torch.tensor([len(s[3]) for s in specs])  # tokens each row already has
        if self.record_routing and bool(offsets.any()):
            raise ValueError("continue_generation: a resumed row's routing is not recorded; "
                             "partial rollouts need record_routing=False")
        rows_prompts = [s[0] + s[3] for s in specs]
        rows = len(rows_prompts)
        prompt_lens = torch.tensor([len(p) for p in rows_prompts])
        width = int(prompt_lens.max())
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(rows_prompts):  # left padding: every row's next token is at column `width`
            input_ids[r, width - len(p):] = torch.tensor(p)
            attention_mask[r, width - len(p):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        input_ids, attention_mask, position_ids = input_ids.to(dev), attention_mask.to(dev), position_ids.to(dev)

        uniforms = None if sampling.greedy else _row_uniforms(sampling, [s[1:3] for s in specs]).to(dev)
        budget = sampling.max_new_tokens - offsets  # tokens each row may still make
        steps = int(budget.max())
        if uniforms is not None:  # each step's column of every row's stream, picked once
            at = (offsets[:, None] + torch.arange(steps)).clamp(max=sampling.max_new_tokens - 1)
            uniforms = uniforms.gather(1, at.to(dev))
        stop = set() if sampling.ignore_eos else set(self.eos_token_ids) | set(sampling.stop_token_ids)
        stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=dev)
        temperature = 1.0 if sampling.greedy else sampling.temperature

        # each step's tokens, log-probs and which rows were still decoding stay on the device;
        # they are read back once at the end (one host sync per step at most: the stop check)
        step_tokens, step_logps, step_alive = [], [], []
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        budget_dev = budget.to(dev)
        bounded = bool((budget < steps).any())  # a continued row may stop before the others
        routing_steps: list[torch.Tensor] = []
        recording = self._recording(routing_steps) if self.record_routing else contextlib.nullcontext()
        cache = (self.lean_forward.cache(width + steps) if self.lean_forward is not None
                 else preallocated_cache(self.model.config, width + steps))
        paused = False
        # every step's mask is a view of one: the prompt's columns, then one per decoded token
        full_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, steps))], dim=1)
        firsts, inverse = distinct_rows(rows_prompts)
        with recording as record:
            if record or len(firsts) == rows:
                logits = self._forward(input_ids, attention_mask, position_ids, cache)
                if record:
                    record(rows, width)
            else:
                # the n samples of a prompt share its prefill (as SGLang's prefix cache does):
                # each distinct prompt is run once, its KV cache and next-token logits copied to
                # its rows
                one = torch.tensor(firsts, device=dev)
                logits = self._forward(input_ids[one], attention_mask[one], position_ids[one], cache)
                every = torch.tensor(inverse, device=dev)
                cache.reorder_cache(every)
                logits = logits[every]
            for step in range(steps):
                scaled = logits / temperature
                if sampling.greedy:
                    tokens = scaled.argmax(-1)
                else:
                    # inverse CDF with each row's own uniform: a row's draw does not depend on
                    # which other rows share the batch
                    cdf = self._filtered(scaled, sampling).softmax(-1).cumsum(-1)
                    u = (uniforms[:, step:step + 1].to(cdf.dtype) * cdf[:, -1:]).clamp_(min=1e-30)
                    tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
                step_logps.append(scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
                step_tokens.append(tokens)
                step_alive.append(~finished)
                if stop or bounded:  # else no row finishes before the last step: nothing to ask the device
                    if stop:
                        finished |= torch.isin(tokens, stop_ids)
                    if bounded:
                        finished |= budget_dev <= step + 1
                    if bool(finished.all()):
                        break
                if step == steps - 1:
                    break
                if should_pause is not None and should_pause():
                    paused = True
                    break
                attention_mask = full_mask[:, :width + step + 1]
                position_ids = position_ids[:, -1:] + 1
                logits = self._forward(tokens[:, None], attention_mask, position_ids, cache)
                if record:
                    record(rows, 1)
        del cache
        # a row decodes until its stop token (included) or its budget, so its alive steps are a prefix
        lengths = torch.stack(step_alive, 1).sum(1).tolist()
        responses = [t[:n] for t, n in zip(torch.stack(step_tokens, 1).tolist(), lengths)]
        log_probs = [lp[:n] for lp, n in zip(torch.stack(step_logps, 1).tolist(), lengths)]
        done = finished.tolist()

        stop_set = set(stop_ids.tolist())
        finish = [FINISH_PAUSED if paused and not done[r] else
                  FINISH_STOP if responses[r][-1] in stop_set else FINISH_LENGTH for r in range(rows)]
        routed = None
        if self.record_routing:
            every_position = torch.cat(routing_steps, dim=1)  # [rows, width + steps, hidden layers, top_k]
            routed = [every_position[r, width - int(prompt_lens[r]): width + len(responses[r]) - 1].clone()
                      for r in range(rows)]
        return RolloutOutput(prompt_index=[r // sampling.n for r in range(rows)],
                             responses=responses, log_probs=log_probs, finish_reasons=finish,
                             routed_experts=routed)
