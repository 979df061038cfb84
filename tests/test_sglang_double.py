"""The SGLang double behaving like SGLang where the GPU path depends on it, and the adapter
(engine/rollout/sglang.py) against it: the engine's scheduler processes (one per TP rank, joining
their group with torch's tcp:// rendezvous in the environment they inherited: a colocated engine
under torchrun must not hand them TORCHELASTIC_USE_AGENT_STORE), the arguments a real engine
refuses, deterministic inference (ServerArgs + a seed per request) and block-FP8 model dirs."""
import json
import os
import sys

import pytest

from tests.test_e2e import ROOT

FAKES = os.path.join(ROOT, "tests", "fakes")
AGENT = "TORCHELASTIC_USE_AGENT_STORE"


@pytest.fixture
def double(monkeypatch):
    """The double importable as `sglang` in this process (and its spawned children)."""
    monkeypatch.syspath_prepend(FAKES)
    import sglang
    sglang.RECORDS.clear()
    yield sglang
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        sys.modules.pop(name)


def tiny_model_dir(path, heads=2, **extra):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=heads,
                num_key_value_heads=heads, vocab_size=64, **extra).save_pretrained(str(path))
    return str(path)


def inits(records):
    return [e for e in records if e["kind"] == "init"]


def test_colocated_engine_starts_under_torchrun(sglang_colocated_run):
    """The real trainer under torchrun (which sets TORCHELASTIC_USE_AGENT_STORE=True in every
    worker), a colocated TP-2 engine: its scheduler processes join their group, and the run ends.
    The run is tests/conftest.py's sglang_colocated_run (3 steps; test_rollout_pool compares a
    separate pool with it); it fails unless every rank exits 0."""
    root, _ = sglang_colocated_run
    records = [json.loads(line) for line in (root / "colocated.sglang").read_text().splitlines()]
    init, = inits(records)
    assert [(s["tp_rank"], s["gpu_id"], s[AGENT]) for s in init["schedulers"]] == [(0, 0, None), (1, 1, None)]
    # the training process keeps torchrun's environment for its own later rendezvous
    assert all(e["trainer_env"][AGENT] == "True" for e in records if e["kind"] == "generate")
    assert [e["kind"] for e in records].count("generate") >= 1


def test_engine_environment_drops_only_the_agent_store(double, tmp_path, monkeypatch):
    """The scheduler processes start without the agent store; the variable is back afterwards."""
    from engine.rollout.sglang import SGLangRollout
    monkeypatch.setenv(AGENT, "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rollout = SGLangRollout(None, model_path=tiny_model_dir(tmp_path / "m"))
    try:
        assert os.environ[AGENT] == "True"
        (info,) = inits(double.RECORDS)[0]["schedulers"]
        assert info[AGENT] is None and info["status"] == "ready"
    finally:
        rollout.shutdown()


def test_agent_store_in_the_schedulers_fails_naming_the_variable(double, tmp_path, monkeypatch):
    """What the GPU would do: the rendezvous waits for torchrun's agent store; the double bounds
    the wait and names the variable."""
    monkeypatch.setenv(AGENT, "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TRIDENT_FAKE_SGLANG_DIST_TIMEOUT_S", "3")
    with pytest.raises(RuntimeError, match=f"inherited {AGENT}=True"):
        double.Engine(model_path=tiny_model_dir(tmp_path / "m"), tp_size=1)


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(tp_size=2, base_gpu_id=1), {"LOCAL_WORLD_SIZE": "2"}, "needs GPU 2, but this node has 2"),
    (dict(tp_size=4), {"CUDA_VISIBLE_DEVICES": "0,1"}, "needs GPU 3, but this node has 2"),
    (dict(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1"), {"WORLD_SIZE": "8"}, "does not split over nnodes=2"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1"), {"WORLD_SIZE": "8"}, "node ranks are 0..1"),
    (dict(tp_size=2, nnodes=2), {"WORLD_SIZE": "8"}, "needs dist_init_addr"),
    (dict(tp_size=4), {"WORLD_SIZE": "8"}, "num_attention_heads=2 .* not divisible by tp_size=4"),
    (dict(tp_size=0), {}, "tp_size=0"),
])
def test_impossible_placements_are_refused(double, tmp_path, monkeypatch, kwargs, env, message):
    for key in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        double.Engine(model_path=tiny_model_dir(tmp_path / "m"), **kwargs)
    assert inits(double.RECORDS) == []  # nothing started


def test_each_tp_rank_gets_its_own_process_and_gpu(double, tmp_path, monkeypatch):
    """base_gpu_id 2 + TP 2 on a 4-GPU node: processes on GPUs 2 and 3, one world of 2."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    engine = double.Engine(model_path=tiny_model_dir(tmp_path / "m"), tp_size=2, base_gpu_id=2)
    try:
        infos = inits(double.RECORDS)[0]["schedulers"]
        assert [(s["tp_rank"], s["gpu_id"]) for s in infos] == [(0, 2), (1, 3)]
        assert len({s["pid"] for s in infos} | {os.getpid()}) == 3
    finally:
        engine.shutdown()
    assert all(not proc.is_alive() for _, proc, _ in engine.schedulers)


# -- deterministic inference (actor_rollout_ref.rollout.deterministic) ------------------------

DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _rollout_from_config(overrides):
    """The trainer's own rollout construction (engine/train.py build_rollout) for the demo recipe."""
    from engine.config import derive, load_config
    from engine.loading import load_hf_config, load_tokenizer
    from engine.train import build_rollout
    cfg = load_config(DEMO, ["actor_rollout_ref.rollout.name=sglang", "trainer.n_gpus_per_node=1", *overrides])
    tokenizer = load_tokenizer(cfg)
    derived = derive(cfg, 1, dataset_len=1 << 30)
    hf_config = load_hf_config(cfg.actor_rollout_ref.model, vocab_size=len(tokenizer))
    return hf_config, build_rollout(derived.config, derived.rollout_topology, hf_config, tokenizer, dp_rank=0)


def _deterministic_run(on):
    """On a 1-rank world (tests.multirank): the trainer's rollout for the demo recipe with
    rollout.deterministic=on, and two generations through the adapter."""
    from engine.rollout.base import SamplingParams
    sys.path.insert(0, FAKES)
    try:
        import sglang
        sglang.RECORDS.clear()
        import torch
        from transformers import AutoModelForCausalLM
        hf_config, group = _rollout_from_config([f"actor_rollout_ref.rollout.deterministic={str(on).lower()}",
                                                 "actor_rollout_ref.rollout.seed=5"])
        torch.manual_seed(0)
        group.engine.begin_weight_update()
        group.engine.update_weights(list(AutoModelForCausalLM.from_config(hf_config).state_dict().items()))
        group.engine.finish_weight_update()
        sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=11)
        both = group.engine.generate(PROMPTS, sampling, keys=[40, 41, 42])
        alone = group.engine.generate([PROMPTS[1]], sampling, keys=[41])
        group.shutdown()
        return dict(records=list(sglang.RECORDS), both=(both.responses, both.log_probs),
                    alone=(alone.responses, alone.log_probs))
    finally:
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            sys.modules.pop(name)


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("on", [False, True])
def test_deterministic_key_drives_the_engine_and_the_request_seeds(on):
    from engine.rollout.sglang import request_seed
    from tests.multirank import run_on_ranks
    (got,) = run_on_ranks(_deterministic_run, 1, on)
    (init,) = inits(got["records"])
    assert init["kwargs"]["enable_deterministic_inference"] is on and init["kwargs"]["random_seed"] == 5
    call = [e for e in got["records"] if e["kind"] == "generate"][0]
    if not on:  # one request per prompt, n samples, no seed (sglang would ignore it)
        assert call["prompts"] == PROMPTS and call["sampling_params"]["n"] == 3
        assert "sampling_seed" not in call["sampling_params"]
        return
    # one request per sample, each with the seed of (seed, key, sample)
    assert call["prompts"] == [p for p in PROMPTS for _ in range(3)]
    assert [p["sampling_seed"] for p in call["sampling_params"]] == [
        request_seed(11, k, j) for k in (40, 41, 42) for j in range(3)]
    assert all(p["n"] == 1 for p in call["sampling_params"])
    responses, logps = got["both"]
    assert len({tuple(r) for r in responses[:3]}) > 1  # a prompt's samples differ
    # a prompt draws the same responses in another batch (a resumed run rebatches)
    assert got["alone"] == (responses[3:6], logps[3:6])


def test_double_refuses_a_seed_the_engine_would_ignore(double, tmp_path, monkeypatch):
    """Real sglang reads sampling_seed only with enable_deterministic_inference."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM
    engine = double.Engine(model_path=tiny_model_dir(tmp_path / "m"), tp_size=1)
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path / "m")))
        engine.rollout.update_weights(list(model.state_dict().items()))
        engine.rollout.finish_weight_update()
        params = dict(n=1, temperature=1.0, max_new_tokens=2, sampling_seed=3)
        with pytest.raises(ValueError, match="enable_deterministic_inference"):
            engine.generate(input_ids=[[1, 2]], sampling_params=params)
        del params["sampling_seed"]
        assert len(engine.generate(input_ids=[[1, 2]], sampling_params=params)) == 1
    finally:
        engine.shutdown()


def test_deterministic_is_refused_where_nothing_makes_it_true():
    from engine.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.deterministic=True: .*transformers"):
        load_config(DEMO, ["actor_rollout_ref.rollout.name=hf", "trainer.device=cuda",
                           "actor_rollout_ref.rollout.deterministic=true"])


def test_a_two_node_engine_meets_at_dist_init_addr(double, tmp_path, monkeypatch):
    """TP 2 over two one-GPU nodes: each node's engine starts its own TP rank on its GPU 0, and
    the two ranks form one world at dist_init_addr (node 0 hosts it)."""
    import socket
    import threading
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model, engines, errors = tiny_model_dir(tmp_path / "m"), {}, []

    def start(node):
        try:
            engines[node] = double.Engine(model_path=model, tp_size=2, nnodes=2, node_rank=node,
                                          dist_init_addr=f"127.0.0.1:{port}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=start, args=(node,)) for node in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors, errors
        got = sorted((e["kwargs"]["node_rank"], s["tp_rank"], s["gpu_id"])
                     for e in inits(double.RECORDS) for s in e["schedulers"])
        assert got == [(0, 0, 0), (1, 1, 0)]
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_a_request_the_kv_pool_cannot_hold_is_aborted_and_never_trained_on(double, tmp_path, monkeypatch):
    """SGLang aborts a sequence its whole KV pool cannot hold (retract_decode's last request) and
    returns what it had with finish_reason abort; the adapter refuses it (it was mapped to 'stop'
    and trained on as a finished response) and names the fix. One that fits is served whole."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.rollout.base import FINISH_LENGTH, SamplingParams
    from engine.rollout.sglang import RolloutAborted, SGLangRollout
    from parallel import device_memory
    path = tiny_model_dir(tmp_path / "m")  # 1 layer, 2 KV heads of 8 dims: 128 B per token in fp32
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
                  .parameters()) * 4
    pool_tokens = 10
    monkeypatch.setenv(device_memory.DIR_ENV, str(tmp_path / "devices"))
    monkeypatch.setenv(device_memory.BYTES_ENV, str(2 * (weights + pool_tokens * 128)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rollout = SGLangRollout(AutoConfig.from_pretrained(path), model_path=path, dtype="float32",
                            gpu_memory_utilization=0.5)
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        rollout.engine.rollout.update_weights(list(model.state_dict().items()))
        rollout.engine.rollout.finish_weight_update()
        fits = rollout.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1))
        assert len(fits.responses[0]) == 6 and fits.finish_reasons == [FINISH_LENGTH]
        with pytest.raises(RolloutAborted, match=r"aborted 1 of 2 requests.*4 prompt tokens \+ 6 generated.*"
                                                 r"Out of memory.*gpu_memory_utilization"):
            rollout.generate([[1, 2], [1, 2, 3, 4]], SamplingParams(max_new_tokens=7, ignore_eos=True, seed=1))
    finally:
        rollout.shutdown()


@pytest.mark.parametrize("tp", [2, 8])
def test_every_engine_of_a_two_node_layout_gets_its_exact_arguments(double, tmp_path, monkeypatch, tp):
    """Through the adapter, on every node of 2 nodes x 4 GPUs (issue 26 class 4): the arguments
    each sglang.Engine receives, written out by hand per rank, and the double's check of what a
    real engine accepts (a GPU id beyond the node is refused; node 1 counts its GPUs from 0)."""
    from engine.rollout.sglang import SGLangRollout
    from engine.rollout.topology import rollout_topology
    from sglang.srt.entrypoints.engine import check_arguments
    received = {}

    class Recorder:  # sglang.Engine's constructor as the double checks it, without processes
        def __init__(self, **kwargs):
            check_arguments(kwargs, os.environ)
            received[int(os.environ["RANK"])] = {k: kwargs.get(k) for k in
                                                 ("tp_size", "base_gpu_id", "nnodes", "node_rank", "dist_init_addr")}
    monkeypatch.setattr(double, "Engine", Recorder)
    path = tiny_model_dir(tmp_path / "m", heads=8)
    topology = rollout_topology(world_size=8, gpus_per_node=4, tp=tp)
    for rank in range(8):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 4))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        if topology.builds_engine(rank):
            SGLangRollout(None, model_path=path, placement=topology.engine_fields(rank, "10.0.0.1:2345"))
    if tp == 2:  # four engines, two per node, each on its node's GPUs 0-1 or 2-3
        one = dict(tp_size=2, nnodes=None, node_rank=None, dist_init_addr=None)
        assert received == {0: dict(one, base_gpu_id=0), 2: dict(one, base_gpu_id=2),
                            4: dict(one, base_gpu_id=0), 6: dict(one, base_gpu_id=2)}
    else:  # one engine over both nodes: each node's first rank starts its half at GPU 0
        both = dict(tp_size=8, base_gpu_id=0, nnodes=2, dist_init_addr="10.0.0.1:2345")
        assert received == {0: dict(both, node_rank=0), 4: dict(both, node_rank=1)}
    monkeypatch.setenv("RANK", "6")
    with pytest.raises(ValueError, match="needs GPU 7, but this node has 4"):
        Recorder(tp_size=2, base_gpu_id=6, model_path=path)  # the global rank as a GPU id


def test_a_keyword_that_is_no_server_args_field_is_refused(double, tmp_path):
    """sglang.Engine(**kwargs) builds the ServerArgs dataclass: a misspelt field (here the
    CUDA-graph switch rollout.enforce_eager drives) fails before anything starts."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'disable_cuda_graphs'"):
        double.Engine(model_path=tiny_model_dir(tmp_path / "m"), disable_cuda_graphs=True)
    assert inits(double.RECORDS) == []
    from engine.rollout.sglang import engine_kwargs
    from sglang.srt.entrypoints.engine import check_arguments
    check_arguments(engine_kwargs(tiny_model_dir(tmp_path / "m"), "float32", "dummy", 1, 0.5, 64, 0,
                                  False, False, enforce_eager=True, enable_chunked_prefill=False), {})


def test_multi_turn_drives_the_engine_through_async_generate_on_its_loop(double, tmp_path, monkeypatch):
    """A multi-turn rollout sends each trajectory's turns to SGLang as requests of their own
    (Engine.async_generate, awaited on Engine.loop), and gets the trajectories the batched rounds
    get (deterministic: each request samples from its own seed); one turn per request."""
    import torch

    from engine.rollout.base import SamplingParams
    from engine.rollout.multi_turn import Limits
    from engine.rollout.sglang import SGLangRollout
    from engine.rollout.tool_actor import multi_turn_generate
    from tests.test_multi_turn import make_tool_actor, tool_happy_model

    tok, actor = make_tool_actor(max_chars=24)
    model, end = tool_happy_model(tok)
    path = str(tmp_path / "m")
    model.config.save_pretrained(path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rollout = SGLangRollout(model.config, model_path=path, dtype="float32", eos_token_ids=[tok.eos_token_id],
                            enable_deterministic_inference=True)
    try:
        rollout.begin_weight_update()
        rollout.update_weights(list(model.state_dict().items()))
        rollout.finish_weight_update()
        prompts = [tok.encode(f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False) for a, b in ((123, 456), (7, 8))]
        run_engine = multi_turn_generate(lambda e, p, s, k: e.generate(p, s, keys=k), lambda: actor,
                                         decode=tok.decode, end_tag=[end], limits=Limits(120, max_assistant_turns=4))
        sampling = SamplingParams(n=3, max_new_tokens=120, seed=5)
        double.RECORDS.clear()
        concurrent = run_engine(rollout, prompts, sampling, [0, 1])
        kinds = [r["kind"] for r in double.RECORDS]
        assert kinds.count("async_generate") == sum(s["turns"] for s in concurrent.stats) and "generate" not in kinds
        assert all(len(r["prompts"]) == 1 for r in double.RECORDS if r["kind"] == "async_generate")
        assert max(s["turns"] for s in concurrent.stats) >= 3
        rollout.ASYNC_GENERATE = False  # the same rollout in batched rounds
        rounds = run_engine(rollout, prompts, sampling, [0, 1])
        assert concurrent.responses == rounds.responses and concurrent.loss_masks == rounds.loss_masks
        assert torch.allclose(torch.tensor(sum(concurrent.log_probs, [])), torch.tensor(sum(rounds.log_probs, [])))
    finally:
        rollout.shutdown()


def test_a_request_awaited_on_another_event_loop_is_refused(double, tmp_path):
    """sglang's result loop runs on the loop of the engine's first request (Engine.loop for the
    blocking calls): a request awaited on another loop would hang; the double raises instead."""
    import asyncio
    engine = double.Engine(model_path=tiny_model_dir(tmp_path / "m"), tp_size=1)
    try:
        engine.rollout.update_weights(list(__import__("transformers").AutoModelForCausalLM.from_config(
            engine.rollout.model.config).state_dict().items()))
        engine.rollout.finish_weight_update()
        params = {"max_new_tokens": 2, "temperature": 1.0}
        assert len(engine.generate(input_ids=[[1, 2]], sampling_params=params)) == 1
        one = engine.loop.run_until_complete(engine.async_generate(input_ids=[1, 2], sampling_params=params))
        assert isinstance(one, dict) and len(one["meta_info"]["output_token_logprobs"]) == 2
        with pytest.raises(RuntimeError, match="Engine.loop"):
            asyncio.run(engine.async_generate(input_ids=[[1, 2]], sampling_params=params))
    finally:
        engine.shutdown()
