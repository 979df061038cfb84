"""The offline losses are layout-invariant and equal their written formulas.

One `update_pairs` of the reward model (Bradley-Terry) and of the DPO policy on the same pairs
gives the same updated weights under DP 1 / 2, TP 2, PP 2, micro-batches of 1 / 2 / 4 pairs,
dynamic (token-budget) micro-batches and unpacked rows (fp32; Adam's first step moves each weight
by ~lr, so differences stay at fp32 rounding: atol 1e-5 with lr 1e-3). And the loss the update
reports equals the formula applied to scores / log-probs that transformers computes from the
same checkpoint, written out here independently of engine/algorithms/pair_losses.py.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.tiny_models import tiny_config

PAIRS, P, R = 8, 5, 6


def _examples(vocab, seed=3, margins=True, ref=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(PAIRS):
        ids = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
        plen, clen, rlen = (int(torch.randint(lo, hi + 1, (1,), generator=g))
                            for lo, hi in ((2, P), (1, R), (1, R)))
        ex = dict(index=i, prompt_ids=ids(plen), chosen_ids=ids(clen), rejected_ids=ids(rlen))
        if margins:
            ex["margin"] = float(torch.rand(1, generator=g)) - 0.3
        if ref:  # plausible summed log-probs of a random model (log 96 ~ 4.6 per token)
            ex["ref_chosen_logps"] = -4.6 * clen + float(torch.randn(1, generator=g))
            ex["ref_rejected_logps"] = -4.6 * rlen + float(torch.randn(1, generator=g))
        out.append(ex)
    return out


def _cfgs(micro, dynamic, packed, loss_type="sigmoid"):
    from engine.config import ActorConfig, DpoConfig, MegatronConfig, ModelConfig, OptimConfig
    meg = MegatronConfig(params_dtype="float32", use_distributed_optimizer=True)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0)
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                        ppo_max_token_len_per_gpu=2 * (P + R), megatron=meg, optim=optim)
    return actor, ModelConfig(use_remove_padding=packed), DpoConfig(beta=0.5, loss_type=loss_type)


def _worker(task, hf, micro, dynamic, packed, loss_type="sigmoid", tp=1):
    from engine.workers.pairs import DPOWorker, RewardModelTrainWorker
    actor, model, dpo = _cfgs(micro, dynamic, packed, loss_type)
    actor = dataclasses.replace(actor, megatron=dataclasses.replace(
        actor.megatron, tensor_model_parallel_size=tp))
    if task == "rm":
        return RewardModelTrainWorker(hf, actor, model)
    return DPOWorker(hf, actor, model, dpo)


def _my_pairs(examples):
    from megatron.core import parallel_state as ps

    from engine.data.preference import pair_batch
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = len(examples) // dp
    return pair_batch(examples[rank * per:(rank + 1) * per], pad_token_id=0)


def _run_update(layout, task, micro, dynamic, packed):
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    init_mesh(Layout(**layout), seed=1)
    hf = tiny_config("llama")
    worker = _worker(task, hf, micro, dynamic, packed, tp=layout.get("tp", 1))
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    worker.optimizer.reload_model_params()
    metrics = worker.update_pairs(_my_pairs(_examples(hf.vocab_size)))
    return metrics, dict(iter_global(worker.chunks, "param"))


def _collect(results):
    weights = {}
    for _, w in results:
        weights.update(w)
    return results[0][0], weights


_REF = {}


def _reference(task):
    if task not in _REF:
        _REF[task] = _collect(run_on_ranks(_run_update, 1, {}, task, 4, False, True))
    return _REF[task]


CASES = [  # (name, ranks, layout, micro pairs, dynamic, packed)
    ("micro1", 1, {}, 1, False, True),
    ("micro2_unpacked", 1, {}, 2, False, False),
    ("dynamic", 1, {}, None, True, True),
    ("dp2_micro1", 2, {}, 1, False, True),
    ("dp2_micro2", 2, {}, 2, False, True),
    ("tp2", 2, dict(tp=2), 2, False, True),
    ("pp2", 2, dict(pp=2), 2, False, True),
]


@pytest.mark.parametrize("task", ["rm", "dpo"])
@pytest.mark.parametrize("name,ranks,layout,micro,dynamic,packed", CASES,
                         ids=[c[0] for c in CASES])
def test_update_is_layout_invariant(task, name, ranks, layout, micro, dynamic, packed):
    ref_metrics, ref_weights = _reference(task)
    metrics, weights = _collect(run_on_ranks(_run_update, ranks, layout, task, micro, dynamic,
                                             packed))
    assert weights.keys() == ref_weights.keys()
    moved = max(float((ref_weights[k] - weight_for(k, ref_weights[k].shape)).abs().max())
                for k in ref_weights)
    assert moved > 5e-4  # the update did something
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], atol=1e-5, rtol=0, msg=k)
    for k in ("loss", "grad_norm"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5), k


# -- the loss against its written formula, with transformers' scores / log-probs ------------------
def _loss_on_ranks(hf_dir, task, loss_type):
    from engine.models.hf_io import load_hf_weights
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    hf = transformers.AutoConfig.from_pretrained(hf_dir)
    worker = _worker(task, hf, 1, False, True, loss_type)
    load_hf_weights(worker.chunks, hf_dir, hf_config=hf)
    worker.optimizer.reload_model_params()
    return worker.update_pairs(_my_pairs(_examples(hf.vocab_size)))


def _hf_model(tmp_path, task):
    cfg = tiny_config("llama", pad_token_id=0)
    torch.manual_seed(0)
    if task == "rm":
        cfg.num_labels = 1
        model = transformers.LlamaForSequenceClassification(cfg).eval()
    else:
        model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    return model, cfg.vocab_size


def test_bradley_terry_loss_matches_formula(tmp_path):
    model, vocab = _hf_model(tmp_path, "rm")
    examples = _examples(vocab)

    def score(prompt, response):
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt + response])).logits[0, 0].double()

    c = torch.stack([score(e["prompt_ids"], e["chosen_ids"]) for e in examples])
    r = torch.stack([score(e["prompt_ids"], e["rejected_ids"]) for e in examples])
    m = torch.tensor([e["margin"] for e in examples], dtype=torch.float64)
    expected = (-torch.log(torch.sigmoid(c - r - m))).mean()
    metrics = run_on_ranks(_loss_on_ranks, 2, str(tmp_path), "rm", "sigmoid")[0]  # DP 2
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(float((c > r).double().mean()), abs=1e-9)
    assert metrics["margin"] == pytest.approx(float((c - r).mean()), rel=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_matches_formula(tmp_path, loss_type):
    model, vocab = _hf_model(tmp_path, "dpo")
    examples = _examples(vocab)
    beta = 0.5

    def logp(prompt, response):  # summed log-probs of the response tokens
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        return lp.gather(-1, torch.tensor(response)[:, None]).sum()

    pc = torch.stack([logp(e["prompt_ids"], e["chosen_ids"]) for e in examples])
    pr = torch.stack([logp(e["prompt_ids"], e["rejected_ids"]) for e in examples])
    rc = torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float64)
    rr = torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float64)
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        expected = -F.logsigmoid(beta * h).mean()
    else:
        expected = ((h - 1 / (2 * beta)) ** 2).mean()
    metrics = run_on_ranks(_loss_on_ranks, 2, str(tmp_path), "dpo", loss_type)[0]
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["rewards/chosen"] == pytest.approx(float(beta * (pc - rc).mean()), rel=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(float(beta * (pr - rr).mean()), rel=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(float(beta * h.mean()), rel=1e-5)
    assert metrics["rewards/accuracies"] == pytest.approx(float((h > 0).double().mean()), abs=1e-9)
    assert metrics["logps/chosen"] == pytest.approx(float(pc.mean()), rel=1e-5)
