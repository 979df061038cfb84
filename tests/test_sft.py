"""SFT (trainer.task=sft): conversations -> ids and an assistant-only loss mask, the loss, its
layout invariance, the trainer end to end, resume, and bad input.

- Tokens: the ids are the whole conversation's single render; the mask covers exactly the
  assistant's content, tool-call text and end-of-turn token (not the role header, not the
  newline after eos); the tokens before each assistant turn are the rollout's prompt (the
  template with the generation prompt). The tools column reaches the template.
- Loss: against masked NLL computed by hand from transformers' logits on the same weights, with
  different masks per conversation (several assistant turns, tool turns in between); labels at
  masked positions do not change the loss or its gradient, whose rows at masked positions are
  exactly zero.
- Layouts: DP 2, TP 2, micro-batches of 1, dynamic batching and unpacked rows give the packed
  DP 1 update (fp32 rounding).
- The recipe: train loss falls and val/loss is logged (in process on 2 ranks; the torchrun
  launch is marked slow); a resumed run ends bit-exactly where an uninterrupted one does.
- Bad input: a row without messages, a template breaking the prefix property, over-long rows by
  data.truncation, keys an SFT run does not read: one clear line each.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from engine.errors import DataError
from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny_sft_tools.yaml")


def _tok():
    from engine.tasks import build_agent_tokenizer
    return build_agent_tokenizer()


def _conversation(a=123, b=456, system=False):
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": json.dumps({"expression": f"{a}*{b}"})}}
    msgs = [{"role": "user", "content": f"{a}*{b}="},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]
    return ([{"role": "system", "content": "Use tools."}] if system else []) + msgs


# -- tokens and mask ---------------------------------------------------------------------------
def test_mask_covers_exactly_the_assistant_turns():
    from engine.data.sft import SFTDataset
    tok = _tok()
    msgs = _conversation(system=True)
    e = SFTDataset([{"messages": msgs}], tok, 400)[0]
    ids = e["prompt_ids"] + e["response_ids"]
    mask = [0] * len(e["prompt_ids"]) + e["loss_mask"]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # the single render's ids
    pieces, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            pieces.append(tok.decode(run))
            run = []
    assert pieces == ['<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}'
                      '</tool_call><|im_end|>', "56088<|im_end|>"]
    # what precedes each assistant turn is the rollout's prompt: generation prompt included
    first = mask.index(1)
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert ids[:first] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert e["prompt_ids"] == ids[:first]


def test_tools_column_reaches_the_template_as_list_or_json():
    from engine.data.sft import SFTDataset
    tok = _tok()
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    plain = SFTDataset([{"messages": _conversation()}], tok, 600)[0]
    listed = SFTDataset([{"messages": _conversation(), "tools": tools}], tok, 600)[0]
    text = SFTDataset([{"messages": _conversation(), "tools": json.dumps(tools)}], tok, 600)[0]
    assert listed == text
    assert '"expression": {"type": "string"}' in tok.decode(listed["prompt_ids"])
    assert len(listed["prompt_ids"]) > len(plain["prompt_ids"])
    assert listed["response_ids"] == plain["response_ids"]
    assert listed["loss_mask"] == plain["loss_mask"]


def test_parquet_rows_with_nulls_and_the_builtin_conversations(tmp_path):
    """parquet fills a message's missing fields with nulls; they are dropped before rendering."""
    from engine.data.prompts import write_prompt_parquet
    from engine.data.sft import SFTDataset, tool_conversations
    rows = tool_conversations(6, seed=2)
    write_prompt_parquet(rows, str(tmp_path / "sft.parquet"))
    from_file = SFTDataset(str(tmp_path / "sft.parquet"), _tok(), 160)
    in_memory = SFTDataset(rows, _tok(), 160)
    assert from_file.examples == in_memory.examples and len(in_memory) == 6


# -- bad input ---------------------------------------------------------------------------------
def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_row_without_messages_is_one_line():
    from engine.data.sft import SFTDataset
    with pytest.raises(DataError) as e:
        SFTDataset([{"messages": _conversation()}, {"prompt": "1+1="}], _tok(), 400)
    _one_line(e, "SFT row 1", "'messages'", "data.messages_key")
    with pytest.raises(DataError) as e:
        SFTDataset([{"messages": [{"role": "robot", "content": "hi"}]}], _tok(), 400)
    _one_line(e, "SFT row 0", "'robot'")


def test_template_breaking_the_prefix_property_is_one_line():
    """Qwen2.5-style: consecutive tool turns share one user turn, so adding a tool turn rewrites
    the end of the one before it."""
    from engine.data.sft import SFTDataset
    tok = _tok()
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
        "\n<tool_response>{{ m.content }}</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = _conversation()
    msgs.insert(3, {"role": "tool", "content": "again"})
    good = {"messages": _conversation()}
    with pytest.raises(DataError) as e:
        SFTDataset([good, good, {"messages": msgs}], tok, 400)
    _one_line(e, "SFT row 2", "prefix property", "message 3 (tool)")


@pytest.mark.parametrize("truncation", ["error", "filter", "left", "right"])
def test_overlong_rows_follow_data_truncation(truncation):
    from engine.data.sft import SFTDataset
    tok = _tok()
    full = SFTDataset([{"messages": _conversation()}], tok, 400)[0]
    ids = full["prompt_ids"] + full["response_ids"]
    mask = [0] * len(full["prompt_ids"]) + full["loss_mask"]
    limit = len(ids) - 10
    rows = [{"messages": _conversation()}]
    if truncation == "error":
        with pytest.raises(DataError) as e:
            SFTDataset(rows, tok, limit)
        _one_line(e, "SFT row 0", f"> data.max_length={limit}", "data.truncation")
        return
    data = SFTDataset(rows, tok, limit, truncation=truncation)
    if truncation == "filter":
        assert len(data) == 0 and data.metrics["data/dropped_overlong"] == 1
        return
    e = data[0]
    kept = slice(-limit, None) if truncation == "left" else slice(0, limit)
    assert e["prompt_ids"] + e["response_ids"] == ids[kept]
    assert [0] * len(e["prompt_ids"]) + e["loss_mask"] == mask[kept]
    assert data.metrics["data/truncated_conversations"] == 1


def test_rows_without_assistant_tokens_are_dropped_or_refused():
    from engine.data.sft import SFTDataset
    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": []},
            {"messages": _conversation()}]
    data = SFTDataset(rows, _tok(), 400, truncation="filter")
    assert len(data) == 1 and data.metrics["data/dropped_empty"] == 2
    with pytest.raises(DataError) as e:
        SFTDataset(rows, _tok(), 400)
    _one_line(e, "SFT row 0", "no assistant message")


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("data.max_prompt_length=64", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n"),
    ("data.builtin_task=arith", "data.builtin_task"),
    ("algorithm.dpo.beta=0.3", "algorithm.dpo.beta"),
    ("data.chosen_key=good", "data.chosen_key"),
])
def test_keys_an_sft_run_does_not_read_are_refused(override, key):
    from engine.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [override])
    _one_line(e, key)


def test_sft_keys_are_refused_by_other_tasks():
    from engine.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "recipes", "tiny_dpo_arith.yaml"), ["data.max_length=64"])
    _one_line(e, "data.max_length", "trainer.task='sft' only")


# -- the loss ----------------------------------------------------------------------------------
def test_loss_is_masked_and_its_masked_gradients_are_zero():
    """The kernel's loss equals masked NLL on the full logits; labels at masked positions change
    nothing; gradient rows of masked predictions are exactly zero."""
    from engine.workers.sft import sft_token_loss
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64).float()
    w = torch.randn(50, 16, generator=g) * 0.5
    labels = torch.randint(0, 50, (23,), generator=g)
    mask = (torch.rand(23, generator=g) > 0.5).float()
    weight = mask / mask.sum()

    def run(lab, chunk):
        hh = h.clone().requires_grad_(True)
        loss = sft_token_loss(hh, w, lab, weight, chunk_tokens=chunk)
        loss.backward()
        return loss.detach(), hh.grad

    logits = h.double() @ w.double().T
    expected = -(torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0] * weight).sum()
    loss, grad = run(labels, 5)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))
    assert (grad[mask == 1].abs().sum(-1) > 0).all()
    other = torch.where(mask == 0, (labels + 7) % 50, labels)
    loss2, grad2 = run(other, 5)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
    loss3, grad3 = run(labels, None)  # one chunk, as use_fused_kernels=false
    torch.testing.assert_close(loss3, loss)
    torch.testing.assert_close(grad3, grad)


P_MAX, R_MAX, CONVERSATIONS = 6, 10, 8


def _examples(vocab, seed=5):
    """Conversations of random ids with distinct masks: several runs of loss tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(CONVERSATIONS):
        plen = int(torch.randint(1, P_MAX + 1, (1,), generator=g))
        rlen = int(torch.randint(3, R_MAX + 1, (1,), generator=g))
        mask = (torch.rand(rlen, generator=g) > 0.4).long()
        mask[0] = 1  # a response starts at the first assistant token
        out.append(dict(index=i, prompt_ids=torch.randint(1, vocab, (plen,), generator=g).tolist(),
                        response_ids=torch.randint(1, vocab, (rlen,), generator=g).tolist(),
                        loss_mask=mask.tolist()))
    return out


def _sft_worker(hf, micro, dynamic, packed, tp=1):
    from engine.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from engine.workers.sft import SFTWorker
    meg = MegatronConfig(params_dtype="float32", use_distributed_optimizer=True,
                         tensor_model_parallel_size=tp)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0)
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                        ppo_max_token_len_per_gpu=P_MAX + R_MAX, megatron=meg, optim=optim)
    return SFTWorker(hf, actor, ModelConfig(use_remove_padding=packed))


def _my_share(examples):
    from megatron.core import parallel_state as ps

    from engine.data.sft import sft_batch
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = len(examples) // dp
    return sft_batch(examples[rank * per:(rank + 1) * per], pad_token_id=0)


def _run_update(layout, micro, dynamic, packed):
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    init_mesh(Layout(**layout), seed=1)
    hf = tiny_config("llama")
    worker = _sft_worker(hf, micro, dynamic, packed, tp=layout.get("tp", 1))
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    worker.optimizer.reload_model_params()
    metrics = worker.update_sft(_my_share(_examples(hf.vocab_size)))
    return metrics, dict(iter_global(worker.chunks, "param"))


def _collect(results):
    weights = {}
    for _, w in results:
        weights.update(w)
    return results[0][0], weights


_REF = {}


def _reference():
    if not _REF:
        _REF["packed"] = _collect(run_on_ranks(_run_update, 1, {}, 4, False, True))
    return _REF["packed"]


LAYOUTS = [  # (name, ranks, layout, micro, dynamic, packed)
    ("unpacked", 1, {}, 4, False, False),
    ("micro1_dynamic", 1, {}, None, True, True),
    ("dp2_micro1", 2, {}, 1, False, True),
    ("dp2_unpacked", 2, {}, 2, False, False),
    ("tp2", 2, dict(tp=2), 2, False, True),
]


@pytest.mark.parametrize("name,ranks,layout,micro,dynamic,packed", LAYOUTS,
                         ids=[c[0] for c in LAYOUTS])
def test_update_is_layout_invariant(name, ranks, layout, micro, dynamic, packed):
    ref_metrics, ref_weights = _reference()
    metrics, weights = _collect(run_on_ranks(_run_update, ranks, layout, micro, dynamic, packed))
    moved = max(float((w - weight_for(k, w.shape)).abs().max()) for k, w in ref_weights.items())
    assert moved > 5e-4  # the update did something
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], atol=1e-5, rtol=0, msg=k)
    for k in ("loss", "actor/grad_norm"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5), k


def _loss_on_ranks(hf_dir):
    from engine.models.hf_io import load_hf_weights
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    hf = transformers.AutoConfig.from_pretrained(hf_dir)
    worker = _sft_worker(hf, 2, False, True)
    load_hf_weights(worker.chunks, hf_dir, hf_config=hf)
    worker.optimizer.reload_model_params()
    return worker.update_sft(_my_share(_examples(hf.vocab_size)))


def test_loss_matches_masked_nll_by_hand_on_transformers_logits(tmp_path):
    cfg = tiny_config("llama", pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    total, count = 0.0, 0
    for e in _examples(cfg.vocab_size):
        ids = e["prompt_ids"] + e["response_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        for t, (token, m) in enumerate(zip(e["response_ids"], e["loss_mask"])):
            at = len(e["prompt_ids"]) + t - 1  # the position that predicts it
            if m:
                total -= float(torch.log_softmax(logits[at], -1)[token])
                count += 1
    metrics = run_on_ranks(_loss_on_ranks, 2, str(tmp_path))[0]  # DP 2, micro-batches of 2
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-5)


# -- the trainer -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The recipe's conversations, fewer (64 train, 16 held out), as parquet files with the
    agent tokenizer saved beside them: the data.train_files path, and a quick build."""
    from engine.data.prompts import write_prompt_parquet
    from engine.data.sft import tool_conversations
    from engine.tasks import save_tokenizer
    d = tmp_path_factory.mktemp("sft_data")
    save_tokenizer(str(d / "tok"), "multiply")
    write_prompt_parquet(tool_conversations(64, 1), str(d / "train.parquet"))
    write_prompt_parquet(tool_conversations(16, 1, split="test"), str(d / "val.parquet"))
    return ["data.builtin_task=null", f"actor_rollout_ref.model.tokenizer_path={d}/tok",
            f"data.train_files=[{d}/train.parquet]", f"data.val_files=[{d}/val.parquet]"]


def _train(tmp, *extra):
    """Build and fit the recipe on these ranks; (final weights, metrics records on rank 0)."""
    import torch.distributed as dist

    from engine.config import load_config
    from engine.offline.build import build_offline
    from engine.trainer import set_seed
    from parallel.shards import iter_global
    cfg = load_config(RECIPE, ["trainer.total_training_steps=4", "trainer.save_hf=false",
                               "trainer.logger=[jsonl]", f"trainer.log_dir={tmp}/logs",
                               f"trainer.default_local_dir={tmp}/ck", *extra])
    set_seed(cfg.trainer.seed + dist.get_rank())
    trainer = build_offline(cfg, 2)
    trainer.fit()
    weights = dict(iter_global(trainer.model.chunks, "param"))
    records = [json.loads(x) for x in open(f"{tmp}/logs/metrics.jsonl")] if trainer.rank == 0 \
        else None
    return weights, records


def test_recipe_trains_and_logs_the_held_out_loss(tmp_path, small_data):
    _, records = run_on_ranks(_train, 2, str(tmp_path), *small_data, "trainer.test_freq=4",
                              "trainer.save_freq=-1", "trainer.resume_mode=disable")[0]
    train = [r["train/loss"] for r in records if "train/loss" in r]
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert len(train) == 4 and train[-1] < train[0] - 0.3
    assert sorted(val) == [0, 4] and val[4] < val[0]
    last = records[-1]
    for key in ("train/grad_norm", "train/lr", "train/global_tokens", "train/loss_tokens"):
        assert key in last, key
    assert 0 < last["train/loss_tokens"] < last["train/global_tokens"]


def test_resumed_run_matches_an_uninterrupted_one(tmp_path, small_data):
    common = [*small_data, "trainer.save_freq=2", "trainer.test_freq=-1",
              "trainer.val_before_train=false", "data.dataloader_num_workers=1"]
    straight = run_on_ranks(_train, 2, str(tmp_path / "s"), *common)[0]
    run_on_ranks(_train, 2, str(tmp_path / "r"), *common, "trainer.total_training_steps=2")
    resumed = run_on_ranks(_train, 2, str(tmp_path / "r"), *common, "trainer.resume_mode=auto")[0]
    assert [r["step"] for r in resumed[1]] == [1, 2, 3, 4]
    for a, b in zip(straight[1][2:], resumed[1][2:]):
        for key in ("train/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
    for k, w in straight[0].items():
        assert torch.equal(resumed[0][k], w), k


def test_held_out_loss_is_the_training_loss_on_the_same_data(tmp_path, small_data):
    """val/loss is the token mean over every held-out assistant token (not a mean of row means):
    held out = the training file, one step over all of it, at the same initial weights."""
    train = [x for x in small_data if x.startswith("data.train_files")][0]
    val = train.replace("data.train_files", "data.val_files")
    _, records = run_on_ranks(_train, 2, str(tmp_path), *small_data, val,
                              "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                              "trainer.total_training_steps=1", "trainer.test_freq=1",
                              "trainer.save_freq=-1", "trainer.resume_mode=disable")[0]
    assert records[0]["step"] == 0 and records[1]["step"] == 1
    assert records[0]["val/loss"] == pytest.approx(records[1]["train/loss"], rel=1e-5)


@pytest.mark.slow
def test_recipe_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", RECIPE, "trainer.total_training_steps=6", "trainer.test_freq=6",
           f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs",
           "trainer.logger=[console,jsonl]"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r["train/loss"] for r in records if "train/loss" in r]
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert len(train) == 6 and train[-1] < train[0]
    assert sorted(val) == [0, 6] and val[6] < val[0]
    assert (tmp_path / "ckpt" / "hf" / "step_6" / "config.json").exists()


def test_dataclass_fields_named_as_verl():
    """data.messages_key / tools_key / max_length, verl's SFT names and defaults."""
    from engine.config.schema import DataConfig
    names = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert names["messages_key"] == "messages" and names["tools_key"] == "tools"
    assert names["max_length"] == 1024
