"""A plain transformers GRPO loop doing the same work as one Trident step, for comparison.

Per step and per rank (its share of the prompts, the trainer's threads per rank, no gradient
sync — which favours the baseline): `model.generate` with a KV cache, the old log-probs and the
reference log-probs (full-logits forwards), then forward + backward + Adam over the same
mini/micro-batches. With `grad_sync` the ranks train one model, as Trident's ranks do: after each
mini-batch's backward passes, one all-reduce (gloo) of every gradient in one reused flat buffer,
the least a synchronous data-parallel step sends: both sides then pay for data parallelism. When
Trident's step is on-policy and takes the old log-probs from the update's forward
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


def _worker(rank, nproc, recipe, overrides, steps, out, grad_sync=False, port=None):
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
    torch.manual_seed(0)  # one initial model on every rank: with grad_sync they train one model
    cfg = load_config(recipe, list(overrides) + [f"trainer.n_gpus_per_node={nproc}"])
    d = derive(cfg, nproc, dataset_len=10_000)
    cfg = d.config
    arr = cfg.actor_rollout_ref
    hf = load_hf_config(arr.model)
    policy = transformers.AutoModelForCausalLM.from_config(hf)
    ref = transformers.AutoModelForCausalLM.from_config(hf)
    ref.load_state_dict(policy.state_dict())
    torch.manual_seed(rank)  # each rank samples its own responses
    opt = torch.optim.Adam(policy.parameters(), lr=arr.actor.optim.lr)
    sync, flat = grad_sync and nproc > 1, torch.empty(0)
    if sync:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
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
            if sync:  # the mini-batch's gradients summed over the ranks: one flat all-reduce
                grads = [p.grad for p in policy.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads], out=flat)  # one buffer, reused
                dist.all_reduce(flat)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        lap("update_actor")
        phases["step"], phases["cpu/step"] = time.perf_counter() - t0, time.process_time() - c0
        phases["faults/step"] = page_faults() - f0
        phases["threads"] = torch.get_num_threads()
        phases["grad_sync"] = sync
        times.append(phases)
    if sync:
        dist.destroy_process_group()
    # the trained weights, summed: equal on every rank when the ranks trained one model
    out.put((rank, times, float(sum(p.detach().double().sum() for p in policy.parameters()))))


def run_baseline(recipe, overrides, nproc, steps, grad_sync=False):
    """{"step": s, phase: s, ..., "cpu/step": s, "cpu/<phase>": s, "faults/<phase>": n}: per step
    the slowest rank's wall (and CPU) seconds of each phase, rank 0's page faults, then the
    median over the steps after the first (warm-up) one. `grad_sync`: the ranks train one model
    ("grad_sync" is then 1 where there is more than one rank); "same_weights": whether every
    rank ended with the same weights (they start from one)."""
    import multiprocessing as mp
    import queue
    import socket
    import statistics

    with socket.socket() as s:  # the loop's own rendezvous (grad_sync): a free port here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, recipe, overrides, steps, out, grad_sync, port))
             for r in range(nproc)]
    for p in procs:
        p.start()
    got = []
    while len(got) < len(procs):  # a rank that died (a bad config) ends the wait, not the hour
        try:
            got.append(out.get(timeout=5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"the plain loop's rank(s) {dead} failed (their traceback is above)")
    results = {rank: times for rank, times, _ in got}
    sums = [weights for _, _, weights in got]
    for p in procs:
        p.join()
    measured = range(1, steps) if steps > 1 else range(steps)
    def per_step(name, s):
        return results[0][s][name] if name.startswith("faults/") else max(results[r][s][name] for r in results)
    summary = {name: statistics.median(per_step(name, s) for s in measured) for name in results[0][0]}
    summary["same_weights"] = max(sums) - min(sums) <= 1e-9 * max(abs(x) for x in sums)
    return summary
