"""Torch modules for Megatron's local (non-TransformerEngine) layer spec.

Megatron's local spec lacks two things Trident needs when TE is absent (CPU, or a GPU without
TE): a norm that works with sequence parallelism, and a core attention that accepts separate
key/value head sizes (MLA). It also runs SwiGLU as separate ops (`GatedMLP` fuses their
backward), and on one TP rank on the CPU Megatron's linears as one product without Megatron's
per-call Python (`OneRankLinear`, bit for bit). These are plain torch; TE's fused versions
replace them when present.

Tests: tests/test_fusions.py, tests/test_layouts.py, tests/test_step_overhead.py,
tests/gpu/test_attention_gpu.py
"""
import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from torch.nn.attention import SDPBackend, sdpa_kernel


class Norm(torch.nn.Module):
    """RMSNorm / LayerNorm with Megatron's constructor; SP-aware.

    Under sequence parallelism each TP rank normalises a different slice of the sequence, so
    the weight gradients must be summed over TP: Megatron does that for parameters carrying
    `sequence_parallel=True`, which this module sets from the config.
    """

    def __init__(self, config, hidden_size, eps=1e-5, **unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization={config.normalization!r} is not supported; "
                             "use RMSNorm or LayerNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        # Norm statistics in fp32 (as HF does) so bf16 runs match the reference closely.
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * y.to(x.dtype)
        y = F.layer_norm(xf, xf.shape[-1:], None, None, self.eps).to(x.dtype)
        return y * self.weight + self.bias


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up of fc1's output [..., 2F] = [gate | up] (each TP rank's own halves).

    The backward writes both halves' gradients into one tensor: Megatron's unfused path splits
    with chunk, adds glu_linear_offset (0) to `up`, and its backward concatenates the halves
    again (an extra pass and copy of the widest activation)."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(x, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        x, act = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        dx = torch.empty_like(x)
        d_gate, d_up = dx.chunk(2, dim=-1)
        torch.mul(grad, act, out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return dx


class GatedMLP(MLP):
    """Megatron's MLP; with SwiGLU, no bias-activation fusion, no clamp or offset (the local
    spec's case), the activation is `SwiGLU`, else Megatron's own forward runs. Not a spec
    entry: Megatron's layer passes the TP group only to a spec naming MLP itself, so the built
    MLPs take this class (`use_gated_mlp`)."""

    def _plain_swiglu(self):
        c = self.config
        return (c.gated_linear_unit and c.activation_func is F.silu and not c.use_te_activation_func
                and not c.bias_activation_fusion and c.activation_func_clamp_value is None
                and not c.glu_linear_offset)

    def _halves_apart(self, x):
        """Whether fc1 runs as its gate and up halves, two products: on the CPU, one TP rank,
        Megatron's plain linear without bias, in a forward without gradients (reference, old
        log-probs, values) or, in training, with its weight trained (`HalvesSwiGLU`). There the
        one [2F]-wide product runs ~7 % slower in place than two [F]-wide ones, and silu / mul
        then read contiguous halves: the forward ~5 % faster, at parity with transformers'
        (README, stop 41). On a GPU one wide GEMM is the better kernel, and TP / SP keep
        Megatron's linear. A linear with hooks (LoRA's adapter: engine/models/lora.py) runs as
        itself: the halves would skip them."""
        fc1 = self.linear_fc1
        if not (isinstance(fc1, ColumnParallelLinear) and plain_on_one_rank(fc1, x)):
            return False
        return not torch.is_grad_enabled() or (fc1.weight.requires_grad and not fc1.sequence_parallel
                                               and not self.config.defer_embedding_wgrad_compute)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self._plain_swiglu():
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        if self._halves_apart(hidden_states):
            fc1 = self.linear_fc1
            if torch.is_grad_enabled():
                return self.linear_fc2(HalvesSwiGLU.apply(hidden_states, fc1.weight,
                                                          fc1.gradient_accumulation_fusion))
            gate, up = fc1.weight.chunk(2)  # row blocks: contiguous views
            return self.linear_fc2(F.silu(F.linear(hidden_states, gate)).mul_(F.linear(hidden_states, up)))
        hidden, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            hidden = hidden + bias
        return self.linear_fc2(SwiGLU.apply(hidden))


class HalvesSwiGLU(torch.autograd.Function):
    """silu(x W_gate^T) * (x W_up^T) for fc1's weight W = [W_gate; W_up] on one TP rank, as two
    products on the weight's row halves, with Megatron's weight-gradient contract
    (tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication): with
    gradient-accumulation fusion the weight gradient is added into `weight.main_grad` (here
    each half by one addmm into its rows), and a weight carrying `grad_added_to_main_grad`
    gets it set and an unused placeholder gradient, so the DDP hook adds nothing twice."""

    @staticmethod
    def forward(ctx, x, weight, accumulate):
        flat = x.reshape(-1, x.shape[-1])
        w_gate, w_up = weight.chunk(2)
        gate, up = F.linear(flat, w_gate), F.linear(flat, w_up)
        act = F.silu(gate)
        ctx.save_for_backward(flat, weight, gate, up, act)
        ctx.accumulate, ctx.shape = accumulate and hasattr(weight, "main_grad"), x.shape
        return (act * up).view(*x.shape[:-1], up.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        flat, weight, gate, up, act = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        d_up = grad * act
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        w_gate, w_up = weight.chunk(2)
        dx = torch.mm(d_gate, w_gate).addmm_(d_up, w_up)
        return dx.view(ctx.shape), weight_grad(weight, flat, (d_gate, d_up), ctx.accumulate), None


def weight_grad(weight, flat, row_grads, accumulate):
    """The weight's gradient under Megatron's contract (tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication.backward) from the output gradients of its
    row blocks `row_grads` ([tokens, rows] each, in order) and the input `flat` [tokens, in]:
    with gradient-accumulation fusion, added into `weight.main_grad` (each block by one addmm
    into its rows) and, for a weight carrying `grad_added_to_main_grad`, that flag set and an
    unused placeholder returned so the DDP hook adds nothing twice; else the gradient itself."""
    if not accumulate:
        grads = [d.t().mm(flat) for d in row_grads]
        return grads[0] if len(grads) == 1 else torch.cat(grads)
    for rows, d in zip(weight.main_grad.split([d.shape[1] for d in row_grads]), row_grads):
        if rows.dtype == d.dtype:
            rows.addmm_(d.t(), flat)
        else:  # bf16 / fp16 activations into an fp32 buffer, as parallel/cpu.py's stand-in
            rows.add_(d.t().mm(flat))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    new = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return new(weight.main_grad.shape, dtype=flat.dtype, device=flat.device)


class OneRankLinear(torch.autograd.Function):
    """x W^T for a weight held whole by one TP rank, with Megatron's weight-gradient contract
    (`weight_grad`): what Megatron's linear computes there, without its Python around it (the
    identity copy / reduce regions and its autograd function's checks, ~50 us a call on the
    CPU, ~17 calls a forward at the 3m benchmark's shapes)."""

    @staticmethod
    def forward(ctx, x, weight, accumulate):
        ctx.save_for_backward(x, weight)
        ctx.accumulate = accumulate and hasattr(weight, "main_grad")
        return torch.matmul(x, weight.t())  # Megatron's product (layers.py), so its rounding

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        dw = weight_grad(weight, x.reshape(-1, x.shape[-1]), (grad.reshape(-1, grad.shape[-1]),),
                         ctx.accumulate) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def plain_on_one_rank(linear, x) -> bool:
    """Whether `linear` is Megatron's own column / row linear (or its Lean class) held whole by
    one TP rank, on the CPU (the GPU keeps Megatron's kernels and fusions), without bias and
    without hooks (LoRA's adapter, engine/models/lora.py, runs as itself)."""
    return (x.device.type == "cpu" and type(linear) in PLAIN_LINEARS and linear.bias is None
            and not (linear._forward_hooks or linear._forward_pre_hooks) and linear.tp_group.size() == 1)


def one_rank_linear(linear, x):
    """`linear`'s output when it can run as `OneRankLinear`, else None: `plain_on_one_rank`, no
    sequence parallelism, no deferred or expert-parallel weight gradients."""
    if not (plain_on_one_rank(linear, x) and not linear.sequence_parallel
            and not linear.config.defer_embedding_wgrad_compute
            and not getattr(linear, "explicit_expert_comm", False)):
        return None
    weight = linear.weight
    if not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        return torch.matmul(x, weight.t())
    return OneRankLinear.apply(x, weight, linear.gradient_accumulation_fusion)


class LeanColumnLinear(ColumnParallelLinear):
    """Megatron's ColumnParallelLinear, through `one_rank_linear` where it applies (same
    parameters, same state dict; `use_one_rank_linears` gives built models this class)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # Megatron's identity copy region hands its product a view with canonical strides, and
        # matmul rounds a packed [t, 1, h] input whose size-1 dimension has another stride
        # differently: the same view here keeps Megatron's results bit for bit
        out = one_rank_linear(self, input_.view(input_.shape)) if weight is None else None
        return super().forward(input_, weight, runtime_gather_output) if out is None else (out, None)


class LeanRowLinear(RowParallelLinear):
    """Megatron's RowParallelLinear, through `one_rank_linear` where it applies."""

    def forward(self, input_):
        out = one_rank_linear(self, input_)
        return super().forward(input_) if out is None else (out, None)


PLAIN_LINEARS = (ColumnParallelLinear, RowParallelLinear, LeanColumnLinear, LeanRowLinear)


def use_one_rank_linears(model):
    """Every linear of `model` built as Megatron's own column / row parallel class takes the
    Lean class (same parameters, same state dict)."""
    for module in model.modules():
        if type(module) is ColumnParallelLinear:
            module.__class__ = LeanColumnLinear
        elif type(module) is RowParallelLinear:
            module.__class__ = LeanRowLinear


def use_gated_mlp(model):
    """Every MLP of `model` built as Megatron's own class runs GatedMLP's forward (same
    parameters, same state dict)."""
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = GatedMLP


class CoreAttention(torch.nn.Module):
    """Causal softmax attention on Megatron's [s, b, heads, dim] layout via torch SDPA.

    Handles grouped-query attention (kv heads repeated), and key/value head sizes that differ
    (MLA), which Megatron's local DotProductAttention does not. Padding is handled by the caller
    as Megatron does: `attention_mask` (bool, True = masked out, [b or 1, 1, s, s]) already holds
    the causal structure when given, e.g. a block-diagonal causal mask for packed sequences;
    without it, attention is plain causal.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self",
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None, **unused):
        super().__init__()
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"attention mask type {attn_mask_type} is not supported by the "
                             "local core attention; only causal attention is")
        self.k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.k_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    sdpa_order = None  # None: CUDA_SDPA_ORDER (tools/bench_attention.py times another)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        with cuda_sdpa_order(query, self.sdpa_order):  # once per call, not per length group
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            mask = None if attention_mask is None else ~attention_mask
            out = self._sdpa(q, k, v, mask)
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _sdpa(self, q, k, v, mask=None):
        """[b, heads, s, d] attention; grouped-query heads are shared, not copied."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=k.shape[1] != q.shape[1])

    def _packed(self, query, key, value, params):
        """THD: [t, heads, dim] with sequences back to back; causal within each sequence.

        The work is the sum of squared lengths, not the square of the packed row's length (RL
        batches pack many short sequences): sequences of equal length are gathered into one
        batched attention call (GRPO's samples of one prompt often share a length), one call
        per distinct length. A group whose sequences lie back to back (all of them, when every
        sequence has one length) is a view of the packed tensors, not a gathered copy."""
        groups = length_groups(params, query.device)
        whole = len(groups) == 1 and isinstance(groups[0][2], slice) \
            and groups[0][2] == slice(0, query.shape[0])
        out = None if whole else query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
        for length, count, where in groups:
            # [n * L, heads, d] -> [n, heads, L, d]
            q, k, v = ((x[where] if isinstance(where, slice) else x.index_select(0, where))
                       .view(count, length, x.shape[1], x.shape[2]).transpose(1, 2)
                       for x in (query, key, value))
            o = self._sdpa(q, k, v)
            o = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])
            if out is None:
                return o.view(o.shape[0], -1)
            if isinstance(where, slice):
                out[where] = o
            else:
                out.index_copy_(0, where, o)
        return out.reshape(out.shape[0], -1)


# On CUDA, torch may pick cuDNN's attention first (aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp, priority order), which builds an execution plan for every new shape: on the
# H200, ~1.3 ms of host time per forward call and ~1.6 ms per backward, where RL batches bring
# new lengths every micro-batch (gpu-check's GRPO step: 4.2 of its 5.5 s of actor passes).
# Flash and memory-efficient attention run any length without a plan; cuDNN and math stay as
# fallbacks for what those two cannot run (fp32 for flash, unequal k / v head sizes, masks).
CUDA_SDPA_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def cuda_sdpa_order(tensor, order=None):
    """The context SDPA runs in: `order` (default CUDA_SDPA_ORDER) on a CUDA tensor; torch's own
    choice elsewhere (the CPU keeps its kernels and results)."""
    if tensor.is_cuda:
        settle_torch_default_order(tensor.device)
        return sdpa_kernel(order or CUDA_SDPA_ORDER, set_priority=True)
    return contextlib.nullcontext()


@functools.cache
def settle_torch_default_order(device):
    """Let torch set its own default SDPA order before any context of ours sets one.

    torch fills in its default order lazily, at the first SDPA call of the process
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, priority_order): on an H100 / H200 with
    a recent cuDNN it then writes cuDNN first into the global order, over the order a context
    set. Were that first call ours, cuDNN would run for the whole call (the first H200 run of
    tests/gpu/test_attention_gpu.py). One tiny call under the math backend (no plan, no order
    of ours) triggers it; torch's default stays torch's for code outside our context."""
    x = torch.zeros(1, 1, 1, 8, device=device)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(x, x, x)


def length_groups(params, device):
    """[(length, sequences, where)] of a packed batch, one per distinct sequence length;
    `where`: the group's tokens, a slice when they are one run, else a token index on `device`.
    Every layer of a micro-batch reads the same packing: it is worked out once and kept on the
    params object (on a GPU, one host read of cu_seqlens per micro-batch instead of two syncs
    per layer)."""
    cached = getattr(params, "_trident_length_groups", None)
    if cached is not None and cached[0] == device:
        return cached[1]
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
        else params.cu_seqlens_q
    cu = cu.to(torch.long).cpu()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    groups = []
    for length in lengths.unique().tolist():
        if length <= 0:
            continue
        first = starts[lengths == length]
        start, stop = int(first[0]), int(first[-1]) + length
        if stop - start == len(first) * length:  # back to back: one run of tokens
            groups.append((length, len(first), slice(start, stop)))
            continue
        index = (first[:, None] + torch.arange(length)).reshape(-1).to(device)
        groups.append((length, len(first), index))
    params._trident_length_groups = (device, groups)
    return groups


def _rotated(t, cos, sin):
    """t * cos + rotate_half(t) * sin over the first cos.shape[-1] channels (the rest pass):
    the same operations as Megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved)."""
    rot = cos.shape[-1]
    x = t if rot == t.shape[-1] else t[..., :rot]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rot == t.shape[-1] else torch.cat((out, t[..., rot:]), dim=-1)


def _positions(t, cu_seqlens, freqs):
    """Each packed token's position inside its sequence (the frequency table's row)."""
    total = t.shape[0]
    if freqs.size(0) == int(cu_seqlens[-1]):
        return torch.arange(total, device=t.device)  # table already per packed token
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(total, device=t.device) - starts.to(t.device)


def _packed_cos_sin(t, cu_seqlens, freqs, mscale):
    """cos / sin of each packed token's frequencies, worked out once per micro-batch: every
    layer, and both q and k, read the same `freqs` table at the same positions (Megatron
    recomputes the gather, cos and sin for each call; HF computes them once per forward). Kept
    on the micro-batch's cu_seqlens tensor, which lives exactly as long as the micro-batch."""
    key = (t.dtype, t.device, float(mscale))
    cached = getattr(cu_seqlens, "_trident_rope", None)
    if cached is not None and cached[0] is freqs and cached[1] == key:
        return cached[2]
    table = freqs[_positions(t, cu_seqlens, freqs)]
    pair = ((torch.cos(table) * mscale).to(t.dtype), (torch.sin(table) * mscale).to(t.dtype))
    cu_seqlens._trident_rope = (freqs, key, pair)
    return pair


def install_fast_thd_rope():
    """RoPE for packed (THD) sequences without a Python loop over the sequences.

    Megatron's unfused THD path builds each sequence's frequencies in a loop of split / slice /
    cat (dozens of small ops per sequence and layer); TE's fused kernel replaces it on GPU.
    Here the per-token position inside its sequence indexes the frequency table once per
    micro-batch (`_packed_cos_sin`). Only without context parallelism, where the two are the
    same computation; interleaved and MLA rotations go through Megatron's own bshd function.
    """
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__",
                       rope_utils._apply_rotary_pos_emb_thd)

    def fast(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
             mscale=1.0, cp_group=None):
        if cp_group is not None and cp_group.size() > 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale,
                            cp_group=cp_group)
        if not rotary_interleaved and not multi_latent_attention:
            cos, sin = _packed_cos_sin(t, cu_seqlens, freqs, mscale)
            return _rotated(t.unsqueeze(1), cos, sin).squeeze(1)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[_positions(t, cu_seqlens, freqs)], rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    fast.__wrapped__ = original
    rope_utils._apply_rotary_pos_emb_thd = fast
