"""A plain transformers GRPO loop doing the same work as one Trident step, for comparison.

Per step and per rank (its share of the prompts, the trainer's threads per rank, no gradient
sync — which favours the baseline): `model.generate` with a KV cache, the old log-probs and the
reference log-probs (full-logits forwards), then forward + backward + Adam over the same
mini/micro-batches. When Trident's step is on-policy and takes the old log-probs from the update's forward
(`Derived.step.reuse_old_log_prob`), the baseline does the same, so both do the same work.

Each step is timed phase by phase under Trident's phase names (gen, old_log_prob, ref,
update_actor; the weight hand-off is none: generation uses the trained model itself), so
`tools/benchmark.py step --baseline` prints a ratio per phase.

Tests: tests/test_benchmark_json.py
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, nproc, recipe, overrides, steps, out):
    sys.path.insert(0, ROOT)
    import torch
    import transformers

    from engine.config import derive, load_config
    from engine.metrics import page_faults
    from engine.tasks import make_builtin_task
    from engine.loading import load_hf_config
    from parallel.cpu import threads_per_process

    # the trainer's threads per rank (engine/train.py): the node's cores over the ranks, so one
    # rank alone gets every core on both sides, not on Trident's only
    torch.set_num_threads(threads_per_process({"LOCAL_WORLD_SIZE": str(nproc)}, os.cpu_count()))
    torch.manual_seed(rank)
    cfg = load_config(recipe, list(overrides) + [f"trainer.n_gpus_per_node={nproc}"])
    d = derive(cfg, nproc, dataset_len=10_000)
    cfg = d.config
    arr = cfg.actor_rollout_ref
    hf = load_hf_config(arr.model)
    policy = transformers.AutoModelForCausalLM.from_config(hf)
    ref = transformers.AutoModelForCausalLM.from_config(hf)
    ref.load_state_dict(policy.state_dict())
    opt = torch.optim.Adam(policy.parameters(), lr=arr.actor.optim.lr)
    rows, _, tok = make_builtin_task(cfg.data.builtin_task or "arith", seed=0, n_train=4096, n_val=1)
    prompts_per_rank = cfg.data.train_batch_size // nproc
    n, width = arr.rollout.n, arr.rollout.response_length
    mini = d.actor.mini_batch_size_per_rank
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    on_policy = d.step.reuse_old_log_prob  # decided once, as the trainer's (engine/config/steps.py)
    times = []
    for step in range(steps):
        t0, c0, f0 = time.perf_counter(), time.process_time(), page_faults()
        phases = {}
        clock = [t0, c0, f0]

        def lap(name):  # wall / CPU seconds and page faults since the last lap, under a Trident phase name
            now, cpu, faults = time.perf_counter(), time.process_time(), page_faults()
            phases[name] = phases.get(name, 0.0) + now - clock[0]
            phases["cpu/" + name] = phases.get("cpu/" + name, 0.0) + cpu - clock[1]
            phases["faults/" + name] = phases.get("faults/" + name, 0) + faults - clock[2]
            clock[:] = now, cpu, faults

        def skip():  # bookkeeping in no phase
            clock[:] = time.perf_counter(), time.process_time(), page_faults()
        batch = [tok.apply_chat_template(rows[(step * 64 + i) % len(rows)]["prompt"],
                                         tokenize=True)["input_ids"]
                 for i in range(prompts_per_rank)]
        longest = max(len(b) for b in batch)
        ids = torch.full((len(batch), longest), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, b in enumerate(batch):
            ids[i, longest - len(b):] = torch.tensor(b)
            mask[i, longest - len(b):] = 1
        with torch.no_grad():
            seqs = policy.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                   max_new_tokens=width, min_new_tokens=width,
                                   num_return_sequences=n, pad_token_id=tok.pad_token_id)
        lap("gen")  # with the prompts' tokenisation, as Trident's gen phase
        full_mask = torch.cat([mask.repeat_interleave(n, 0), torch.ones(seqs.shape[0], width, dtype=torch.long)], 1)

        def logp(model, s, m):
            logits = model(input_ids=s, attention_mask=m).logits[:, longest - 1:-1].float()
            return torch.log_softmax(logits, -1).gather(-1, s[:, longest:, None]).squeeze(-1)

        skip()  # the mask is bookkeeping
        with torch.no_grad():
            old = None if on_policy else torch.cat(
                [logp(policy, seqs[i:i + micro], full_mask[i:i + micro])
                 for i in range(0, len(seqs), micro)])
            if old is not None:
                lap("old_log_prob")
            refl = torch.cat([logp(ref, seqs[i:i + micro], full_mask[i:i + micro])
                              for i in range(0, len(seqs), micro)])
            lap("ref")
        adv = torch.randn(len(seqs), 1)
        skip()
        for start in range(0, len(seqs), mini):
            opt.zero_grad()
            for i in range(start, min(start + mini, len(seqs)), micro):
                lp = logp(policy, seqs[i:i + micro], full_mask[i:i + micro])
                ratio = torch.exp(lp - (lp.detach() if old is None else old[i:i + micro]))
                loss = -(torch.minimum(ratio * adv[i:i + micro],
                                       ratio.clamp(0.8, 1.2) * adv[i:i + micro])).mean()
                loss = loss + 0.001 * (lp - refl[i:i + micro]).pow(2).mean()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        lap("update_actor")
        phases["step"], phases["cpu/step"] = time.perf_counter() - t0, time.process_time() - c0
        phases["faults/step"] = page_faults() - f0
        phases["threads"] = torch.get_num_threads()
        times.append(phases)
    out.put((rank, times))


def run_baseline(recipe, overrides, nproc, steps):
    """{"step": s, phase: s, ..., "cpu/step": s, "cpu/<phase>": s, "faults/<phase>": n}: per step
    the slowest rank's wall (and CPU) seconds of each phase, rank 0's page faults, then the
    median over the steps after the first (warm-up) one."""
    import multiprocessing as mp
    import statistics

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, recipe, overrides, steps, out))
             for r in range(nproc)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    measured = range(1, steps) if steps > 1 else range(steps)
    def per_step(name, s):
        return results[0][s][name] if name.startswith("faults/") else max(results[r][s][name] for r in results)
    return {name: statistics.median(per_step(name, s) for s in measured) for name in results[0][0]}
