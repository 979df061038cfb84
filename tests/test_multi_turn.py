"""engine/rollout/multi_turn.py: trajectories of model turns and observations, token in / token
out, limits, and trajectories that do not wait for each other's tools."""
import threading
import time

import pytest

from engine.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams
from engine.rollout.multi_turn import Limits, Observation, cut_at, run

EOS, TAG, OBS = 2, [7, 8], [30, 31, 32]


class Script:
    """A stand-in engine: row r's turn t answers `turns[r][t]` (ids; a turn ending in TAG calls a
    tool); every call is logged with its time and the rows' prompts (the full history)."""

    def __init__(self, turns, lp=-0.5):
        self.turns, self.lp, self.calls = turns, lp, []

    def __call__(self, prompts, sampling, keys):
        assert sampling.n == 1
        self.calls.append((time.monotonic(), [list(p) for p in prompts]))
        out = []
        for p in prompts:
            row, turn = p[0], sum(1 for i in range(len(p)) if p[i:i + len(TAG)] == TAG)
            ids = list(self.turns[row][turn])[:sampling.max_new_tokens]
            out.append(ids)
        return RolloutOutput(prompt_index=list(range(len(prompts))), responses=out,
                             log_probs=[[self.lp - 0.01 * i for i in range(len(r))] for r in out],
                             finish_reasons=[FINISH_STOP if r and r[-1] == EOS else FINISH_LENGTH for r in out])


class Tools:
    """An Actor: a tool call gets OBS (after `delay[row]` seconds); an answer ends it."""
    timeout_s = 5.0

    def __init__(self, delay=None, fail_rows=()):
        self.delay, self.fail_rows, self.log = delay or {}, set(fail_rows), []

    def act(self, trajectory, text, called):
        row = trajectory.prompt[0]
        self.log.append((time.monotonic(), row, text, called))
        if row in self.fail_rows:
            raise RuntimeError("a bug in the actor")
        if not called:
            return Observation(done=True)
        time.sleep(self.delay.get(row, 0.0))
        return Observation(ids=OBS, tool_calls=1)


def _run(turns, actor, prompts=None, limits=Limits(64), n=1):
    prompts = prompts or [[r, 1, 1] for r in range(len(turns))]
    return run(Script(turns), prompts, SamplingParams(n=n, max_new_tokens=64), list(range(len(prompts))),
               actor=actor, decode=lambda ids: " ".join(map(str, ids)), end_tag=TAG, limits=limits)


def test_a_three_turn_trajectory_is_its_tokens_with_a_model_mask():
    turns = [[[5, 6, *TAG, 9, 9], [5, *TAG], [4, 4, EOS]]]  # what follows the tag is dropped
    out = _run(turns, Tools())
    assert out.responses[0] == [5, 6, *TAG, *OBS, 5, *TAG, *OBS, 4, 4, EOS]
    assert out.loss_masks[0] == [1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert out.turn_starts[0] == [0, 7, 13]
    lps = out.log_probs[0]
    assert lps[:4] == [-0.5, -0.51, -0.52, -0.53] and lps[4:7] == [0.0] * 3  # the engine's, 0 on observations
    assert out.stats[0]["turns"] == 3 and out.stats[0]["observations"] == 2 and out.stats[0]["ended"] == "answer"
    assert out.stats[0]["tool_calls"] == 2 and out.finish_reasons == [FINISH_STOP]


def test_every_turn_sees_the_history_as_ids_never_retokenised():
    turns = [[[5, *TAG], [6, EOS]]]
    script = Script(turns)
    run(script, [[0, 1, 1]], SamplingParams(max_new_tokens=64), [0], actor=Tools(), decode=str,
        end_tag=TAG, limits=Limits(64))
    assert [p for _, ps in script.calls for p in ps] == [[0, 1, 1], [0, 1, 1, 5, *TAG, *OBS]]


@pytest.mark.parametrize("limits, ending, length", [
    (Limits(64, max_assistant_turns=2), "max_assistant_turns", 4 + 3 + 4),  # its call goes unanswered
    (Limits(64, max_user_turns=1), "max_user_turns", 4 + 3 + 4),
    (Limits(9), "length", 9),  # the second observation is cut at the budget
])
def test_limits_end_a_trajectory_and_say_which(limits, ending, length):
    turns = [[[5, 6, *TAG], [5, 6, *TAG], [5, 6, *TAG], [EOS]]]
    out = _run(turns, Tools(), limits=limits)
    assert out.stats[0]["ended"] == ending and len(out.responses[0]) == length


def test_a_slow_tool_does_not_delay_the_other_trajectories():
    """Row 0's tool sleeps 1.5 s; rows 1 and 2 go through their three turns meanwhile."""
    turns = [[[5, *TAG], [EOS]]] + [[[5, *TAG], [5, *TAG], [6, EOS]]] * 2
    tools = Tools(delay={0: 1.5})
    start = time.monotonic()
    out = _run(turns, tools)
    slow_done = [t for t, row, _, _ in tools.log if row == 0][-1]  # row 0's answer after its tool
    others_done = max(t for t, row, _, called in tools.log if row in (1, 2) and not called)
    assert others_done - start < 0.8 < 1.5 <= slow_done - start
    assert [s["ended"] for s in out.stats] == ["answer"] * 3


class AsyncScript(Script):
    """`Script` as an engine serving concurrent requests (RolloutEngine.ASYNC_GENERATE): each
    request takes `latency` seconds while the others proceed; the most in flight at once is kept."""

    def __init__(self, turns, latency=0.01):
        super().__init__(turns)
        self.latency, self.in_flight, self.most = latency, 0, 0

    async def agenerate(self, prompts, sampling, keys):
        import asyncio
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.latency)
        self.in_flight -= 1
        return self(prompts, sampling, keys)


def _run_concurrent(turns, actor, engine=None, limits=Limits(64), n=1):
    import asyncio

    from engine.rollout.multi_turn import run_concurrent
    engine = engine or AsyncScript(turns)
    prompts = [[r, 1, 1] for r in range(len(turns))]
    return run_concurrent(engine.agenerate, asyncio.run, prompts, SamplingParams(n=n, max_new_tokens=64),
                          list(range(len(prompts))), actor=actor, decode=lambda ids: " ".join(map(str, ids)),
                          end_tag=TAG, limits=limits)


def test_concurrent_requests_give_the_rounds_trajectories():
    """One request per trajectory turn (SGLang's async API) gives what the batched rounds give:
    tokens, masks, log-probs, turn starts and stats; the requests really overlap."""
    turns = [[[5, 6, *TAG, 9], [5, *TAG], [4, 4, EOS]], [[3, *TAG], [EOS]], [[6] * 70]]
    engine = AsyncScript(turns)
    concurrent, rounds = _run_concurrent(turns, Tools(), engine), _run(turns, Tools())
    for field in ("responses", "log_probs", "loss_masks", "turn_starts", "stats", "finish_reasons"):
        assert getattr(concurrent, field) == getattr(rounds, field), field
    assert [s["ended"] for s in concurrent.stats] == ["answer", "answer", "length"]
    assert engine.most == 3


def test_concurrent_requests_a_slow_tool_delays_only_its_own_trajectory():
    turns = [[[5, *TAG], [EOS]]] + [[[5, *TAG], [5, *TAG], [6, EOS]]] * 2
    tools = Tools(delay={0: 1.5})
    start = time.monotonic()
    out = _run_concurrent(turns, tools)
    slow_done = [t for t, row, _, _ in tools.log if row == 0][-1]
    others_done = max(t for t, row, _, called in tools.log if row in (1, 2) and not called)
    assert others_done - start < 0.8 < 1.5 <= slow_done - start
    assert [s["ended"] for s in out.stats] == ["answer"] * 3


def test_an_actor_that_raises_ends_its_trajectory_not_the_run():
    turns = [[[5, *TAG], [EOS]], [[5, *TAG], [6, EOS]]]
    out = _run(turns, Tools(fail_rows={0}))
    assert out.stats[0]["ended"] == "answer" and out.stats[0]["tool_errors"] == 1
    assert out.responses[1] == [5, *TAG, *OBS, 6, EOS]


def test_samples_of_a_prompt_draw_their_turns_from_their_own_streams():
    seen = []

    def generate(prompts, sampling, keys):
        seen.append(list(keys))
        return RolloutOutput(prompt_index=list(range(len(prompts))), responses=[[EOS]] * len(prompts),
                             log_probs=[[0.0]] * len(prompts), finish_reasons=[FINISH_STOP] * len(prompts))
    run(generate, [[1], [2]], SamplingParams(n=2, max_new_tokens=4), [10, 11], actor=Tools(), decode=str,
        end_tag=TAG, limits=Limits(8))
    assert len(set(seen[0])) == 4  # (prompt key, sample, turn) -> a stream each


def test_cut_at():
    assert cut_at([1, 7, 8, 9], TAG) == 3 and cut_at([7, 1, 8], TAG) is None and cut_at([1], []) is None


def test_the_loop_runs_in_threads_it_does_not_leave_behind():
    before = threading.active_count()
    _run([[[5, *TAG], [EOS]]], Tools())
    time.sleep(0.2)
    assert threading.active_count() <= before + 1


# -- masking in training ------------------------------------------------------------------
def _masked_update(alter):
    """One actor update (1 rank) on a batch whose responses hold observations (response_mask 0,
    attention 1); `alter` garbles the observation positions' (or, as a control, a model
    position's) training inputs."""
    import torch

    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.test_ppo_update import R, make_batch, make_configs
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    actor_cfg, _, model_cfg = make_configs(use_kl_loss=True, entropy_coeff=0.01)
    worker = ActorWorker(tiny_config("llama"), actor_cfg, model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    batch = make_batch(worker.hf_config.vocab_size)
    valid = batch["response_mask"].clone()
    observation = valid.clone() * 0
    observation[:, 1:3] = valid[:, 1:3]  # tokens 1-2 of each response are an observation
    batch["response_mask"] = valid - observation
    width = batch["responses"].shape[1]
    assert torch.equal(batch["attention_mask"][:, -width:], valid)
    worker.mini_batch_size_per_rank = len(batch)
    old = worker.compute_log_prob(batch, micro_batch_size=3)
    batch["old_log_probs"] = old + batch["noise"] * valid
    batch["ref_log_prob"] = old - 0.5 * batch["noise"] * valid
    where = observation.bool() if alter == "observation" else (batch["response_mask"].bool() & (
        torch.arange(width)[None, :] == 0))
    if alter is not None:
        for key, garbage in (("advantages", 1e3), ("old_log_probs", -50.0), ("ref_log_prob", 7.0)):
            batch[key] = torch.where(where, torch.full_like(batch[key], garbage), batch[key])
    worker.update_policy(batch)
    return {n: t.clone() for n, t in iter_global(worker.chunks)}


def test_observation_tokens_do_not_train():
    """Their advantages, old and reference log-probs garbled: the same update, bit for bit; the
    same garbling at one model token changes it."""
    import torch

    from tests.multirank import run_on_ranks
    [clean] = run_on_ranks(_masked_update, 1, None)
    [garbled] = run_on_ranks(_masked_update, 1, "observation")
    [control] = run_on_ranks(_masked_update, 1, "model")
    assert all(torch.equal(clean[n], garbled[n]) for n in clean)
    assert any(not torch.equal(clean[n], control[n]) for n in clean)


def test_the_loss_gradient_at_observation_logits_is_exactly_zero():
    import torch

    from engine.algorithms.losses import entropy_bonus, kl_loss, policy_loss
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old, ref, adv = logp.detach() + 0.3, logp.detach() - 0.2, torch.randn(2, 6)
    loss = (policy_loss(logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.3)[0]
            + 0.1 * kl_loss(logp, ref, mask) - 0.01 * entropy_bonus(entropy, mask))
    loss.backward()
    grads = logits.grad.abs().sum(-1)
    assert torch.all(grads[mask == 0] == 0) and torch.all(grads[mask == 1] > 0)


def test_the_metrics_count_turns_tools_tokens_and_endings():
    from engine.rollout.multi_turn import ENDINGS, multi_turn_metrics
    turns = [[[5, *TAG], [4, EOS]], [[5, 6, *TAG]] * 3 + [[EOS]]]
    out = _run(turns, Tools(), limits=Limits(64, max_assistant_turns=3))
    m = multi_turn_metrics(out.stats)
    assert (m["num_turns/mean"], m["num_turns/max"], m["num_turns/min"]) == (2.5, 3.0, 2.0)
    # row 0: 2 turns, 1 call answered; row 1: its third call ends it at the turn limit, unanswered
    assert m["multi_turn/tool_calls/mean"] == 1.5 and m["multi_turn/observations/mean"] == 1.5
    assert m["multi_turn/model_tokens/mean"] == (5 + 12) / 2 and m["multi_turn/observation_tokens/mean"] == 4.5
    assert m["multi_turn/ended/answer"] == 0.5 == m["multi_turn/ended/max_assistant_turns"]
    assert {k for k in m if k.startswith("multi_turn/ended/")} == {f"multi_turn/ended/{e}" for e in ENDINGS}


# -- the Actor of verl's multi_turn config, on the agent tokenizer --------------------------
def make_tool_actor(timeout_s=2.0, tools=None, max_chars=None):
    from engine.agents.parsers import get_parser
    from engine.agents.render import observation_ids
    from engine.agents.runner import ToolRunner
    from engine.rollout.tool_actor import ToolActor
    from engine.tasks import build_agent_tokenizer

    tok = build_agent_tokenizer()
    if tools is None:
        from engine.agents.tools import BUILTINS
        tools = {"calculator": BUILTINS["calculator"]()}
    actor = ToolActor(ToolRunner(tools, timeout_s=timeout_s, max_response_chars=max_chars), get_parser("hermes"),
                      lambda messages, ended: observation_ids(tok, messages, model_ended_with_eos=ended))
    return tok, actor


@pytest.mark.parametrize("call, result", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>', "56088"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}</tool_call>', "Error:"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "Error: unknown tool 'search'"),
    ('<tool_call>not json</tool_call>', "Error"),
])
def test_a_tool_call_becomes_the_templates_tool_turn(call, result):
    tok, actor = make_tool_actor()
    obs = actor.act(None, call, called=True)
    text = tok.decode(obs.ids)
    assert text.startswith("<|im_end|>\n<|im_start|>tool\n<tool_response>" + result)
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert obs.tool_calls == 1 and obs.tool_errors == (result != "56088") and not obs.done
    assert actor.act(None, "56088", called=False) == Observation(done=True)  # an answer ends it


def test_a_hanging_tool_is_an_error_observation_within_its_timeout():
    from engine.agents.tools import Tool

    class Hang(Tool):
        name, description = "hang", "never returns"

        def call(self, **_):
            time.sleep(30)
    tok, actor = make_tool_actor(timeout_s=0.3, tools={"hang": Hang()})
    start = time.monotonic()
    obs = actor.act(None, '<tool_call>{"name": "hang", "arguments": {}}</tool_call>', called=True)
    assert time.monotonic() - start < 2.0 and obs.tool_timeouts == 1
    assert "timed out" in tok.decode(obs.ids)


def tool_happy_model(tok, end_logit=0.52, eos_logit=-0.5, max_positions=256):
    """A tiny Llama on the agent tokenizer whose last hidden state is mostly the current token's
    embedding, whose dim 0 every token shares: the tool-call end tag (and the eos) get a fixed
    logit offset after any token (0.52: ~15 % likely), so sampled responses call tools."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    end = tok.convert_tokens_to_ids("</tool_call>")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=0.3, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[end, 0] = end_logit
        model.lm_head.weight[tok.eos_token_id, 0] = eos_logit
    return model, end


def test_cpu_backend_trajectories_are_the_models_own_tokens_and_log_probs():
    """A tiny random Llama on the agent tokenizer, its tool-call end tag made likely: sampled
    trajectories of several turns with (mostly malformed) tool calls and their error
    observations. Teacher-forcing each whole trajectory through the same transformers model gives
    the rollout's log-prob at every model token (fp32), and the observations are the template's."""
    import torch

    from engine.rollout.cpu import CPURollout
    from engine.rollout.multi_turn import Limits
    from engine.rollout.tool_actor import multi_turn_generate

    tok, actor = make_tool_actor(max_chars=24)
    model, end = tool_happy_model(tok)
    config = model.config
    engine = CPURollout(config, eos_token_ids=[tok.eos_token_id])
    engine.sync_weights([list(model.state_dict().items())])
    prompts = [tok.encode(f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
               for a, b in ((123, 456), (7, 8))]
    calls = []

    def generate(e, p, s, k):
        calls.append(len(p))
        return e.generate(p, s, keys=k)
    run_engine = multi_turn_generate(generate, lambda: actor, decode=tok.decode, end_tag=[end],
                                     limits=Limits(160, max_assistant_turns=4))
    out = run_engine(engine, prompts, SamplingParams(n=3, max_new_tokens=160, seed=5), [0, 1])
    assert calls[0] == 6  # every trajectory's first turn in one call
    assert max(s["turns"] for s in out.stats) >= 3 and sum(s["observations"] for s in out.stats) >= 3
    for row, (ids, mask, lps) in enumerate(zip(out.responses, out.loss_masks, out.log_probs)):
        prompt = prompts[out.prompt_index[row]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        model_tokens = torch.tensor(mask).bool()
        assert torch.allclose(ref[model_tokens], torch.tensor(lps)[model_tokens], atol=1e-4), row
        starts = out.turn_starts[row]
        for a, b in zip(starts, starts[1:]):  # between two turns: the end tag, then the tool turn
            observation = [t for t, m in zip(ids[a:b], mask[a:b]) if not m]
            assert tok.decode(observation).startswith("<|im_end|>\n<|im_start|>tool\n<tool_response>Error")


class Checker:
    """An environment: says "higher" until the answer holds 42, then rewards 1 and ends."""

    def __init__(self, config=None):
        self.turns = 0

    def reset(self, prompt):
        return None

    def step(self, action):
        self.turns += 1
        if "42" in action:
            return None, 1.0, True
        return "higher", 0.0, False


class Opening(Checker):
    """A Checker whose reset shows the prompt's last word back as a first user turn."""
    seen = []

    def reset(self, prompt):
        Opening.seen.append(prompt)
        return f"pick one ({prompt.split()[-1]})"


class BrokenReset(Checker):
    def reset(self, prompt):
        raise ValueError("no board")


def _environment_run(env_class, concurrent=False):
    from engine.agents.environments import EnvironmentRunner, EnvironmentSpec
    from engine.agents.parsers import get_parser
    from engine.agents.render import observation_ids
    from engine.agents.runner import ToolRunner
    from engine.rollout.tool_actor import ToolActor, multi_turn_generate
    from engine.tasks import build_agent_tokenizer

    tok = build_agent_tokenizer()
    eos = tok.eos_token_id
    answers = [tok.encode("41", add_special_tokens=False) + [eos], tok.encode("42", add_special_tokens=False) + [eos]]

    def generate(prompts, sampling, keys):  # the n-th answer of a trajectory: count its user turns
        out = [answers[min(1, tok.decode(p).count("higher"))] for p in prompts]
        return RolloutOutput(prompt_index=list(range(len(prompts))), responses=out,
                             log_probs=[[-0.1] * len(r) for r in out], finish_reasons=[FINISH_STOP] * len(out))

    class Engine:  # the same answers as concurrent requests (SGLang's async API)
        ASYNC_GENERATE = True

        async def agenerate(self, prompts, sampling, keys):
            return generate(prompts, sampling, keys)

        def run_async(self, coroutine):
            import asyncio
            return asyncio.run(coroutine)

    def render(messages, ended):
        return observation_ids(tok, messages, model_ended_with_eos=ended, eos_ids=[eos])

    actor = ToolActor(ToolRunner({}, timeout_s=1.0), get_parser("hermes"), render,
                      environments=EnvironmentSpec("checker", env_class).make, env_runner=EnvironmentRunner(1.0),
                      decode_prompt=lambda ids: tok.decode(ids, skip_special_tokens=True))
    run_engine = multi_turn_generate(lambda e, p, s, k: generate(p, s, k), lambda: actor, decode=tok.decode,
                                     end_tag=tok.encode("</tool_call>", add_special_tokens=False), limits=Limits(256))
    prompt = tok.encode("<|im_start|>user\nguess<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = run_engine(Engine() if concurrent else None, [prompt], SamplingParams(max_new_tokens=64), [0])
    return tok, out


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_environment_answers_the_models_answers_until_it_ends_and_rewards(concurrent):
    tok, out = _environment_run(Checker, concurrent)
    text = tok.decode(out.responses[0])
    assert text == "41<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n42<|im_end|>"
    assert out.stats[0]["ended"] == "env_done" and out.stats[0]["reward"] == 1.0 and out.stats[0]["turns"] == 2
    model = [t for t, m in zip(out.responses[0], out.loss_masks[0]) if m]
    assert tok.decode(model) == "41<|im_end|>42<|im_end|>"


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_environments_reset_observation_opens_the_trajectory(concurrent):
    """reset(prompt) -> a first user turn before the model's first turn (the prompt's open
    assistant turn closed), masked out; the environment saw the prompt's text."""
    Opening.seen.clear()
    tok, out = _environment_run(Opening, concurrent)
    text = tok.decode(out.responses[0])
    opening = "<|im_end|>\n<|im_start|>user\npick one (assistant)<|im_end|>\n<|im_start|>assistant\n"
    assert text == opening + "41<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n42<|im_end|>"
    assert Opening.seen == ["user\nguess\nassistant\n"]
    first = out.turn_starts[0][0]
    assert tok.decode(out.responses[0][:first]) == opening and not any(out.loss_masks[0][:first])
    assert out.stats[0]["observations"] == 2 and out.stats[0]["turns"] == 2


def test_an_environment_whose_reset_fails_ends_before_any_model_turn():
    tok, out = _environment_run(BrokenReset)
    assert out.stats[0]["turns"] == 0 and out.stats[0]["ended"] == "env_done" and not any(out.loss_masks[0])
    assert "Error: environment BrokenReset reset failed: ValueError: no board" in tok.decode(out.responses[0])


def test_an_environments_reward_joins_the_score_on_the_last_model_token():
    import torch

    from engine.batch import Batch
    from engine.experience.scoring import score_batch
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])  # row 0 ends on an observation

    def rule(responses, response_mask, **_):
        scores = torch.zeros(response_mask.shape, dtype=torch.float64)
        scores[:, 0] = 0.5
        return scores, {"rule_score": [0.5, 0.5]}
    batch = Batch(dict(responses=torch.zeros(2, 6, dtype=torch.long), response_mask=mask),
                  dict(extra_info=[{}, {}], ground_truth=["", ""], data_source=["x", "x"],
                       multi_turn=[dict(reward=2.0), dict(reward=0.0)]))
    scores, extra = score_batch(rule, batch, None, True)
    assert scores.tolist() == [[0.5, 0, 0, 0, 2.0, 0], [0.5, 0, 0, 0, 0, 0]]
    assert extra["environment_reward"] == [2.0, 0.0] and extra["rule_score"] == [0.5, 0.5]


def test_rule_rewards_read_the_last_model_turn():
    import torch

    from engine.experience.scoring import last_turn_mask
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    assert last_turn_mask(mask).tolist() == [[0, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0], [0] * 7]


@pytest.mark.parametrize("shown", [True, False])
def test_the_prompt_shows_the_tools_schemas_as_verl_renders_it(shown):
    from engine.config import load_config
    from engine.loading import load_datasets
    from engine.tasks import build_agent_tokenizer
    import os
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu_demo.yaml")
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(demo, ["data.builtin_task=multiply", "data.max_prompt_length=1024", f"{mt}.enable=true",
                             f"{mt}.tools_in_prompt={str(shown).lower()}"])
    tok = build_agent_tokenizer()
    train, _ = load_datasets(cfg, tok)
    text = tok.decode(train[0]["input_ids"])
    assert ('"name": "calculator"' in text and '"name": "python"' in text) == shown
    assert text.endswith("<|im_start|>assistant\n")


def test_on_the_cpu_backend_a_slow_tool_delays_only_its_own_trajectory():
    """The tool-happy model of the test above on the CPU backend: trajectory (prompt 0, sample 0)'s
    first tool waits until another trajectory has reached a later turn's tool (at most 10 s): a
    driver that waited for every tool before generating would never get there."""
    from engine.rollout.cpu import CPURollout
    from engine.rollout.tool_actor import multi_turn_generate

    tok, _ = make_tool_actor()
    model, end = tool_happy_model(tok, end_logit=0.8, eos_logit=-2.0)
    config = model.config
    engine = CPURollout(config, eos_token_ids=[tok.eos_token_id])
    engine.sync_weights([list(model.state_dict().items())])
    later, waited = threading.Event(), []

    class Slow:
        timeout_s = 15.0

        def act(self, trajectory, text, called):
            where = (trajectory.key, trajectory.sample, trajectory.turns)
            if where[:2] != (0, 0) and where[2] >= 2:
                later.set()
            if where == (0, 0, 1):
                waited.append(later.wait(10.0))
            return Observation(ids=OBS, tool_calls=1) if called else Observation(done=True)
    run_engine = multi_turn_generate(lambda e, p, s, k: e.generate(p, s, keys=k), Slow, decode=tok.decode,
                                     end_tag=[end], limits=Limits(120, max_assistant_turns=6))
    prompt = tok.encode("<|im_start|>user\n1*2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = run_engine(engine, [prompt, prompt], SamplingParams(n=2, max_new_tokens=120, seed=3), [0, 1])
    assert waited == [True]  # the slow trajectory called its tool, and others went on meanwhile
    assert max(s["turns"] for s in out.stats) >= 3
