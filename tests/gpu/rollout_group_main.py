"""`torchrun --nproc_per_node 2 tests/gpu/rollout_group_main.py OUT.json`: training TP 2 on two
GPUs, one SGLang engine with tp_size 2 on rank 0 (the group leader), weights handed over inside
the group (each SGLang TP worker reads its own GPU's copy), then greedy generation compared with
the training model's own argmax. Run by tests/gpu/test_rollout_group_gpu.py."""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PROMPTS = [[5, 17, 42, 8, 61, 3], [90, 2, 33, 71, 12, 44]]
STEPS = 8
NEAR_TIE = 0.25  # bf16 kernels may pick the other of two logits closer than this


def main(out_path):
    from megatron.core import parallel_state as ps

    from engine.rollout.colocated import sync_weights
    from engine.models.builder import build_model
    from engine.rollout.base import SamplingParams
    from engine.rollout.group import GroupedRollout
    from engine.rollout.sglang import SGLangRollout
    from engine.rollout.topology import rollout_topology
    from parallel.mesh import Layout, init_distributed, init_mesh
    from parallel.shards import load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.tiny_models import tiny_config

    init_distributed()
    init_mesh(Layout(tp=2), seed=1)
    hf = tiny_config("llama", vocab_size=128, hidden_size=128, intermediate_size=256, eos_token_id=1)
    chunks = build_model(hf, params_dtype=torch.bfloat16)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(chunks)}
    load_global(chunks, lambda n: weight_for(n, shapes[n]))
    model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
    hf.save_pretrained(model_dir)

    def engine(placement):
        return SGLangRollout(hf, eos_token_ids=[], model_path=model_dir, dtype="bfloat16",
                             placement=placement, gpu_memory_utilization=0.3,
                             max_num_batched_tokens=1024, skip_tokenizer_init=True)

    group = GroupedRollout(rollout_topology(2, 2, 2), SGLangRollout, engine,
                           dp_rank=ps.get_data_parallel_rank())
    stats = sync_weights(chunks, group, hf, bucket_megabytes=1)
    # the training model's greedy continuation and the logit gaps it chose by
    tokens = torch.tensor(PROMPTS, device="cuda")
    gaps = []
    with torch.no_grad():
        for _ in range(STEPS):
            local = chunks[0](tokens, torch.arange(tokens.shape[1], device="cuda").expand_as(tokens), None)
            pieces = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            last = torch.cat(pieces, -1)[:, -1].float()
            top2 = last.topk(2, -1).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
            tokens = torch.cat([tokens, last.argmax(-1)[:, None]], 1)
    expected = tokens[:, len(PROMPTS[0]):].tolist()
    result = dict(rank=dist.get_rank(), holds_engine=group.engine is not None, buckets=stats.buckets)
    if group.is_leader:
        out = group.engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=STEPS))
        agree = []
        for row, (got, want) in enumerate(zip(out.responses, expected)):
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            # equal, or first different where the training logits were a near-tie
            agree.append(k is None or gaps[k][row] < NEAR_TIE)
        result.update(responses=out.responses, expected=expected, agree=agree)
    group.shutdown()
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
