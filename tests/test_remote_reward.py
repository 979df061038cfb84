"""The reward service client (engine/rewards/remote.py) against a real HTTP server this test
starts on loopback (http.server in a thread): a normal service, a slow one (timeout, then a
retry that answers), one that is down (connection refused), one that answers garbage (not JSON,
wrong shape), an OpenAI chat-completions judge; then a 2-step trainer run scored through it,
whose server sees each step's samples once (not once per rank of a TP 2 replica)."""
import dataclasses
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.config.schema_sources import RemoteRewardConfig
from engine.rewards.remote import RemoteReward, RewardServiceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


class Service:
    """A loopback reward service. Paths: /score and /wait (0.1 s a request): score 1 when
    response == ground_truth, else (len(response) + 1) / 100; /slow (the first `slow_first`
    requests sleep past the client's timeout); /flaky (every second request fails, HTTP 500);
    /garbage (not JSON); /shape (JSON without 'scores'); /short (one score for a batch); /judge
    (a chat completion whose reply ends in a number). Records every request."""

    def __init__(self, slow_s=1.0, slow_first=1):
        self.requests, self.lock = [], threading.Lock()
        self.slow_s, self.slow_first = slow_s, slow_first
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests.append((self.path, body, self.headers.get("Authorization")))
                    count = sum(1 for p, _, _ in service.requests if p == self.path)
                if self.path == "/slow" and count <= service.slow_first:
                    time.sleep(service.slow_s)
                if self.path == "/wait":  # long enough for the client's requests to overlap
                    with service.lock:
                        service.in_flight += 1
                        service.max_in_flight = max(service.max_in_flight, service.in_flight)
                    time.sleep(0.1)
                    with service.lock:
                        service.in_flight -= 1
                if self.path == "/flaky" and count % 2 == 0:  # every second request fails
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/garbage":
                    return self._reply(b"<html>502 bad gateway</html>")
                if self.path == "/shape":
                    return self._reply(json.dumps({"result": "ok"}).encode())
                if self.path == "/short":  # one score for the whole batch
                    return self._reply(json.dumps({"scores": [1.0]}).encode())
                if self.path == "/judge":
                    text = body["messages"][0]["content"]
                    answer = "On a scale of 0 to 10: 7" if "Response: 7" in text else "I rate it 2"
                    return self._reply(json.dumps({"choices": [{"message": {"role": "assistant",
                                                                            "content": answer}}]}).encode())
                scores = [1.0 if s["response"] == s["ground_truth"] else {"score": (len(s["response"]) + 1) / 100,
                                                                          "acc": 0.0}
                          for s in body["samples"]]
                self._reply(json.dumps({"scores": scores}).encode())

            def _reply(self, data):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # listen backlog: the clients' bursts of connections all wait

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.in_flight = self.max_in_flight = 0

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _down_url():
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/score"


def _remote(url, **kw):
    cfg = dataclasses.replace(RemoteRewardConfig(), **{"timeout_s": 0.5, "backoff_s": 0.01, **kw})
    return RemoteReward(url, cfg)


TEXTS, TRUTHS = ["7", "12", "abc", "3", "x"], ["7", "12", "9", "4", "x"]


def _score(remote, texts=TEXTS, truths=TRUTHS):
    return remote(["arith"] * len(texts), texts, truths, [{"index": i} for i in range(len(texts))])


def test_normal_service_batches_and_bounds_concurrency():
    with Service() as s:
        out = _score(_remote(f"{s.url}/score", batch_size=2, max_concurrency=2))
        assert [r["score"] for r in out] == [1.0, 1.0, 0.04, 0.02, 1.0]  # the server's rule, in order
        assert out[2]["acc"] == 0.0 and not any(r["remote_failed"] for r in out)
        sizes = [len(body["samples"]) for _, body, _ in s.requests]
        assert sorted(sizes) == [1, 2, 2]  # 5 samples in requests of batch_size 2
        assert sum(r["remote_requests"] for r in out) == pytest.approx(3)
        sent = [x for _, body, _ in s.requests for x in body["samples"]]
        assert sorted(x["extra_info"]["index"] for x in sent) == list(range(5))
        out = _score(_remote(f"{s.url}/wait", batch_size=1, max_concurrency=2))  # 5 requests, 2 at a time
        assert s.max_in_flight == 2 and [r["score"] for r in out] == [1.0, 1.0, 0.04, 0.02, 1.0]


def test_slow_service_times_out_then_the_retry_answers():
    with Service(slow_s=1.5, slow_first=1) as s:
        t0 = time.perf_counter()
        out = _score(_remote(f"{s.url}/slow", batch_size=8, timeout_s=0.5, max_retries=2))
        took = time.perf_counter() - t0
        assert [r["score"] for r in out] == [1.0, 1.0, 0.04, 0.02, 1.0]
        assert len(s.requests) == 2 and out[0]["remote_requests"] * 5 == pytest.approx(2)
        assert 0.5 <= out[0]["remote_latency_s"] <= took  # the timed-out attempt counts in its latency
    with Service(slow_s=1.5, slow_first=10) as s:  # slow every time: the retries run out
        with pytest.raises(RewardServiceError, match=r"5 of 5 samples failed after 2 attempts \(.*timed out"):
            _score(_remote(f"{s.url}/slow", batch_size=8, timeout_s=0.3, max_retries=1))


def test_service_down_is_scored_as_configured():
    url = _down_url()
    with pytest.raises(RewardServiceError, match=r"reward_model.url=.*5 of 5 samples failed after 3 attempts "
                                                 r"\(ConnectionRefusedError.*on_failure to zero or skip"):
        _score(_remote(url, batch_size=2))
    for policy in ("zero", "skip"):
        out = _score(_remote(url, batch_size=2, max_retries=1, on_failure=policy))
        assert [r["score"] for r in out] == [0.0] * 5 and all(r["remote_failed"] for r in out)
        assert sum(r["remote_requests"] for r in out) == pytest.approx(3 * 2)  # 3 requests x 2 attempts


@pytest.mark.parametrize("path, reason", [("garbage", "not JSON"), ("shape", "no list 'scores' of 5"),
                                          ("short", r"no list 'scores' of 5 \(got \{'scores': \[1.0\]\}")])
def test_garbage_replies_fail_with_the_reason(path, reason):
    with Service() as s:
        with pytest.raises(RewardServiceError, match=reason):
            _score(_remote(f"{s.url}/{path}", batch_size=8, max_retries=1))
        assert len(s.requests) == 2  # the retry was made
        out = _score(_remote(f"{s.url}/{path}", batch_size=8, max_retries=0, on_failure="zero"))
        assert all(r["remote_failed"] and r["score"] == 0.0 for r in out)


def test_openai_judge_mode(monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "secret-token")
    with Service() as s:
        remote = _remote(f"{s.url}/judge", mode="openai", model="judge-1", api_key_env="JUDGE_TOKEN")
        out = remote(["chat"] * 2, ["7", "5"], ["7", "7"], [{"raw_prompt": [{"role": "user", "content": "3+4="}]},
                                                            {"raw_prompt": "3+4="}])
        assert [r["score"] for r in out] == [0.7, 0.2]  # the last number / 10: "... 0 to 10: 7", "I rate it 2"
        assert len(s.requests) == 2  # one request per sample
        _, body, auth = s.requests[0]
        assert body["model"] == "judge-1" and body["temperature"] == 0.0 and auth == "Bearer secret-token"
        assert "Question: 3+4=" in body["messages"][0]["content"]


def test_manager_and_metrics_of_a_service(tmp_path):
    from engine import tasks
    from engine.experience.scoring import REMOTE_SUMS
    from engine.rewards import RewardManager
    tok = tasks.build_tokenizer()
    ids = torch.tensor([tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]] * 2)
    mask = torch.ones_like(ids)
    with Service() as s:
        manager = RewardManager(tok, remote=_remote(f"{s.url}/score", batch_size=1))
        scores, extra = manager(ids, mask, ground_truths=["7", "8"], data_sources=["arith"] * 2)
    assert scores.sum(-1).tolist() == [1.0, pytest.approx(0.02)]
    assert extra["remote_failed"] == [False, False] and sum(extra["remote_requests"]) == 2
    assert set(REMOTE_SUMS.values()) <= set(extra)


def test_config_refuses_what_cannot_act():
    with pytest.raises(ConfigError, match="reward_model.remote.timeout_s=5.0: acts only with reward_model.url"):
        load_config(DEMO, ["reward_model.remote.timeout_s=5"])
    with pytest.raises(ConfigError, match="reward_model.url='ftp://x'"):
        load_config(DEMO, ["reward_model.url=ftp://x"])
    with pytest.raises(ConfigError, match="data.return_raw_chat=False: a judge"):
        load_config(DEMO, ["reward_model.url=http://127.0.0.1:9/v1/chat/completions",
                           "reward_model.remote.mode=openai", "reward_model.remote.model=j"])
    with pytest.raises(ConfigError, match="reward_model.remote.model=None"):
        load_config(DEMO, ["reward_model.url=http://127.0.0.1:9/c", "reward_model.remote.mode=openai",
                           "data.return_raw_chat=true"])
    with pytest.raises(ConfigError, match=r"reward_model.num_workers=2: the reward service's requests run in threads"):
        load_config(DEMO, ["reward_model.url=http://127.0.0.1:9/c", "reward_model.num_workers=2"])
    with pytest.raises(ConfigError, match="reward_model.url=.*custom_reward_function.path is set too"):
        load_config(DEMO, ["reward_model.url=http://127.0.0.1:9/c", f"custom_reward_function.path={__file__}"])
    with pytest.raises(ConfigError, match="reward_model.remote.on_failure='retry'"):
        load_config(DEMO, ["reward_model.url=http://127.0.0.1:9/c", "reward_model.remote.on_failure=retry"])


# ---- a trainer run scored through the service ------------------------------------------------

def _steps_through_service(tmp, url, layout, on_failure="stop", steps=2):
    import torch.distributed as dist

    from engine.train import build
    from engine.trainer import Trainer, set_seed

    class Recording(Trainer):
        def compute_advantages(self, batch):
            batch = super().compute_advantages(batch)
            self.seen.append({k: batch[k].clone() for k in ("token_level_scores", "advantages", "reward_skipped")
                              if k in batch})
            return batch

    world = dist.get_world_size()
    from tests.test_replica_scoring import scoring_run
    cfg = load_config(DEMO, scoring_run(tmp, world) + [
        f"reward_model.url={url}", "reward_model.remote.batch_size=1", "reward_model.remote.max_retries=0",
        f"reward_model.remote.on_failure={on_failure}", "reward_model.remote.timeout_s=5", *layout])
    set_seed(cfg.trainer.seed + dist.get_rank())
    t = Recording(*build(cfg, world))
    t.seen, metrics = [], []
    for _ in range(steps):
        metrics.append(t.train_step(t.loader.next_batch()))
        t.step_count += 1
    t.colocated.to_training()
    t.rollout.shutdown()
    keep = {k: [m[k] for m in metrics] for k in metrics[0] if k.startswith("reward_remote/")}
    return dict(rank=dist.get_rank(), metrics=keep, seen=t.seen)


def test_two_steps_score_each_sample_once_per_replica(tmp_path):
    """TP 2 on 2 ranks (one replica): 4 prompts x n=2 = 8 samples a step reach the service
    8 times, not 16; both ranks train on the service's scores."""
    from tests.multirank import run_on_ranks
    with Service() as s:
        ranks = run_on_ranks(_steps_through_service, 2, str(tmp_path), f"{s.url}/score",
                             ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
        sent = [x for _, body, _ in s.requests for x in body["samples"]]
    assert len(s.requests) == len(sent) == 2 * 8  # requests per step == samples per step
    m = ranks[0]["metrics"]
    assert m["reward_remote/requests"] == [8.0, 8.0] and m["reward_remote/failed_samples"] == [0.0, 0.0]
    assert all(0 < a <= b for a, b in zip(m["reward_remote/latency_s/mean"], m["reward_remote/latency_s/max"]))
    for a, b in zip(ranks[0]["seen"], ranks[1]["seen"]):
        assert torch.equal(a["token_level_scores"], b["token_level_scores"])
    # the service's rule reaches the scores: 1 for an exact answer, (len + 1) / 100 otherwise (each > 0)
    assert all((seen["token_level_scores"].sum(-1) > 0).all() for seen in ranks[0]["seen"])
    print(f"remote reward: {len(s.requests) // 2} requests per step for 8 samples; latency mean "
          f"{m['reward_remote/latency_s/mean']} s, max {m['reward_remote/latency_s/max']} s")


def test_skipped_samples_train_nothing(tmp_path):
    """A service failing every second request, on_failure=skip: those samples score 0 and their
    advantages are zeroed (no gradient from a score nobody gave); the others train as scored."""
    from tests.multirank import run_on_ranks
    with Service() as s:
        ranks = run_on_ranks(_steps_through_service, 1, str(tmp_path), f"{s.url}/flaky", [],
                             on_failure="skip", steps=1)
    seen, m = ranks[0]["seen"][0], ranks[0]["metrics"]
    skipped = seen["reward_skipped"]
    assert m["reward_remote/failed_samples"] == [4.0] and m["reward_remote/requests"] == [8.0]
    assert int(skipped.sum()) == 4
    assert torch.count_nonzero(seen["token_level_scores"][skipped]) == 0
    assert torch.count_nonzero(seen["advantages"][skipped]) == 0
    assert torch.count_nonzero(seen["advantages"][~skipped]) > 0  # groups mixing 0 and a score: trained
