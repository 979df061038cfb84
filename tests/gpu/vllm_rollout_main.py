"""`torchrun --nproc_per_node N tests/gpu/vllm_rollout_main.py OUT.json`: a real vLLM engine
(engine/rollout/vllm.py VLLMRollout, SPMD: every rank of the rollout group builds its TP part, as
engine/train.py does) next to a tiny Megatron training model of TP N on N GPUs. The engine starts
with random weights (load_format='dummy'); the training weights arrive through the trainer's sync
(engine/rollout/colocated.py sync_weights: full-tensor buckets, HF names, GroupedRollout.load_bucket);
greedy generation is then compared with the training model's own argmax on the same prefix, and
again after the colocated schedule's release / resume and a second sync. Run by
tests/gpu/test_vllm_gpu.py."""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PROMPTS = [[5, 17, 42, 8, 61, 3], [90, 2, 33, 71, 12, 44], [7, 7, 100]]
STEPS = 8
NEAR_TIE = 0.25  # bf16 kernels may pick the other of two logits closer than this
LOGP_TOL = 0.1   # vLLM's log-prob of a token vs the training log-softmax (bf16 kernels)


@torch.no_grad()
def training_greedy(chunks, prompt, steps):
    """The training model's greedy continuation of `prompt`: its tokens, the logit gap between
    the best two at each step, and the chosen token's log-prob (full vocabulary, fp32)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    tokens = torch.tensor([prompt], device="cuda")
    out, gaps, logps = [], [], []
    for _ in range(steps):
        positions = torch.arange(tokens.shape[1], device="cuda")[None]
        local = chunks[0](tokens, positions, None)
        pieces = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        last = torch.cat(pieces, -1)[0, -1].float()
        top2 = last.topk(2)
        token = int(top2.indices[0])
        out.append(token)
        gaps.append(float(top2.values[0] - top2.values[1]))
        logps.append(float(last.log_softmax(-1)[token]))
        tokens = torch.cat([tokens, torch.tensor([[token]], device="cuda")], 1)
    return out, gaps, logps


def compare(responses, log_probs, expected):
    """Per prompt: equal to the training argmax, or first different at a near-tie; log-probs of
    the agreeing prefix within LOGP_TOL."""
    rows = []
    for got, logp, (want, gaps, want_logp) in zip(responses, log_probs, expected):
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        agree = len(got) == len(want) and (k is None or gaps[k] < NEAR_TIE)
        prefix = len(got) if k is None else k
        logp_err = max((abs(a - b) for a, b in zip(logp[:prefix], want_logp[:prefix])), default=0.0)
        rows.append(dict(agree=agree, first_diff=k, logp_err=logp_err))
    return rows


def main(out_path):
    from megatron.core import parallel_state as ps

    from engine.models.builder import build_model
    from engine.rollout.base import SamplingParams
    from engine.rollout.colocated import sync_weights
    from engine.rollout.group import GroupedRollout
    from engine.rollout.topology import rollout_topology
    from engine.rollout.vllm import VLLMRollout
    from engine.tasks import save_tokenizer
    from parallel.mesh import Layout, init_distributed, init_mesh
    from parallel.shards import load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.tiny_models import tiny_config

    init_distributed()
    world = dist.get_world_size()
    init_mesh(Layout(tp=world), seed=1)
    hf = tiny_config("llama", vocab_size=128, hidden_size=128, intermediate_size=256, eos_token_id=1)
    dirs = [None]
    if dist.get_rank() == 0:  # one directory, written before the broadcast that names it
        dirs[0] = tempfile.mkdtemp(prefix="tiny-llama-vllm-")
        hf.save_pretrained(dirs[0])
        save_tokenizer(dirs[0])  # vLLM loads a tokenizer from the model directory
    dist.broadcast_object_list(dirs, src=0)
    model_dir = dirs[0]

    def engine(placement):  # engine/train.py's vLLM arguments, sized for a test
        return VLLMRollout(hf, eos_token_ids=[], model_path=model_dir, dtype="bfloat16", load_format="dummy",
                           tensor_model_parallel_size=placement["tp_size"], gpu_memory_utilization=0.2,
                           max_num_batched_tokens=256, max_num_seqs=8, enforce_eager=True, seed=0,
                           max_model_len=64)

    # the engines are built before the training model, as in engine/train.py
    group = GroupedRollout(rollout_topology(world, world, world), VLLMRollout, engine,
                           dp_rank=ps.get_data_parallel_rank())
    chunks = build_model(hf, params_dtype=torch.bfloat16)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(chunks)}
    load_global(chunks, lambda n: weight_for(n, shapes[n]))
    for chunk in chunks:
        chunk.eval()

    sampling = SamplingParams(do_sample=False, max_new_tokens=STEPS, ignore_eos=True)
    keys = list(range(len(PROMPTS)))

    def generate():  # the trainer's call: every rank of the group generates (SPMD), each DP rank gets its share
        got = group.generate_for_replicas(PROMPTS, keys, sampling)
        return [got[i][0][0] for i in keys], [got[i][1][0] for i in keys]

    stats = sync_weights(chunks, group, hf, bucket_megabytes=1)
    expected = [training_greedy(chunks, p, STEPS) for p in PROMPTS]
    responses, log_probs = generate()
    # the colocated schedule: memory back to training, then weights, a second sync, the KV cache
    free_awake = torch.cuda.mem_get_info()[0]
    group.release_memory()
    free_asleep = torch.cuda.mem_get_info()[0]
    group.resume_memory(["weights"])
    again = sync_weights(chunks, group, hf, bucket_megabytes=1)
    group.resume_memory(["kv_cache"])
    second, _ = generate()
    result = dict(rank=dist.get_rank(), world=world, buckets=stats.buckets, buckets_again=again.buckets,
                  expected=[e[0] for e in expected], responses=responses,
                  rows=compare(responses, log_probs, expected), second=second, freed=free_asleep - free_awake)
    group.shutdown()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
