"""A reward service (`reward_model.url`): samples go out as JSON over HTTP, scores come back.

Two protocols (`reward_model.remote.mode`):

    json    POST url  {"samples": [{"data_source", "prompt", "response", "ground_truth",
                                    "extra_info"}, ...]}   (batch_size samples per request)
            reply     {"scores": [s, ...]}, one per sample, in order; s is a number or a dict
                      with "score" (its other fields become reward extras, as a rule's do)
    openai  POST url  an OpenAI chat-completions request (model, messages: [{"role": "user",
                      "content": prompt_template filled in}], max_tokens, temperature 0), one
                      sample per request; the score is the last number of the reply (score_regex)
                      divided by score_scale

At most `max_concurrency` requests are in flight (threads, the standard library's http.client).
An attempt that fails (refused connection, timeout_s passed, HTTP error, a reply that is not
JSON or not the shape above) is tried again after backoff_s x 2^k, max_retries times. A sample
whose request failed every attempt is scored by `on_failure`: 'zero' (score 0), 'skip' (score 0,
its `remote_failed` extra set: the trainer zeroes its advantages) or 'stop' (RewardServiceError,
one line). Every sample carries `remote_failed`, `remote_latency_s` (its request's wall time,
retries included) and `remote_requests` (its share of the HTTP attempts): the step's
reward_remote/* metrics (engine/experience/scoring.py) are made from them.

The service is called once per model replica (engine/experience/scoring.py scores on the
replica's first rank), so a step sends each sample once, not once per TP / PP rank.

Tests: tests/test_remote_reward.py
"""
import http.client
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from engine.errors import UserError

__all__ = ["RemoteReward", "RewardServiceError"]


class RewardServiceError(UserError):
    """The reward service failed a sample every attempt and on_failure=stop."""


class _Failed(Exception):
    """One attempt's failure, with the reason shown in the stop line."""


class RemoteReward:
    """compute_score in the batch manager's signature: (data_sources, solution_strs,
    ground_truths, extra_infos) -> one result (dict with "score") per sample."""

    def __init__(self, url, remote, prompts_key="raw_prompt"):
        self.url, self.cfg = url, remote
        parsed = urlparse(url)
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port
        self._path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self._regex = re.compile(remote.score_regex)
        self._token = os.environ.get(remote.api_key_env) if remote.api_key_env else None
        self.prompts_key = prompts_key

    # -- one HTTP attempt ------------------------------------------------------------------
    def _post(self, body):
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.cfg.timeout_s)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            conn.request("POST", self._path, body=json.dumps(body).encode(), headers=headers)
            reply = conn.getresponse()
            data = reply.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
            raise _Failed(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if reply.status != 200:
            raise _Failed(f"HTTP {reply.status}")
        try:
            return json.loads(data)
        except ValueError:
            raise _Failed(f"the reply is not JSON ({data[:60]!r})") from None

    def _json_scores(self, samples):
        reply = self._post({"samples": samples})
        scores = reply.get("scores") if isinstance(reply, dict) else reply
        if not isinstance(scores, list) or len(scores) != len(samples):
            raise _Failed(f"the reply has no list 'scores' of {len(samples)} (got {str(reply)[:80]})")
        out = []
        for s in scores:
            value = s.get("score") if isinstance(s, dict) else s
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _Failed(f"a score is {str(s)[:40]}, not a number or {{'score': number}}")
            out.append(dict(s, score=float(value)) if isinstance(s, dict) else {"score": float(value)})
        return out

    def _judge_score(self, sample):
        c = self.cfg
        text = c.prompt_template.format(prompt=sample["prompt"], response=sample["response"],
                                        ground_truth=sample["ground_truth"])
        reply = self._post({"model": c.model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": c.max_tokens, "temperature": 0.0})
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _Failed(f"the reply is not a chat completion (got {str(reply)[:80]})") from None
        numbers = self._regex.findall(content or "")
        if not numbers:
            raise _Failed(f"the judge's reply holds no score matching {c.score_regex!r}: {content[:60]!r}")
        try:
            return [{"score": float(numbers[-1]) / c.score_scale}]
        except ValueError:
            raise _Failed(f"the judge's score {numbers[-1]!r} is not a number") from None

    # -- one request, retried --------------------------------------------------------------
    def _request(self, samples):
        c, attempts, start, reason = self.cfg, 0, time.perf_counter(), ""
        while attempts <= c.max_retries:
            if attempts:
                time.sleep(c.backoff_s * 2 ** (attempts - 1))
            attempts += 1
            try:
                results = self._json_scores(samples) if c.mode == "json" else self._judge_score(samples[0])
                failed = False
                break
            except _Failed as e:
                reason = str(e)
        else:
            results, failed = [{"score": 0.0} for _ in samples], True
        latency = time.perf_counter() - start
        for r in results:
            r.update(remote_failed=failed, remote_latency_s=latency, remote_requests=attempts / len(samples))
        return results, reason if failed else None

    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos):
        n = len(solution_strs)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        samples = [{"data_source": s, "prompt": _prompt_of(e, self.prompts_key), "response": r,
                    "ground_truth": g, "extra_info": _jsonable(e)}
                   for s, r, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]
        size = self.cfg.batch_size if self.cfg.mode == "json" else 1
        chunks = [samples[i:i + size] for i in range(0, n, size)]
        if not chunks:
            return []
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(chunks)),
                                thread_name_prefix="reward-remote") as pool:
            parts = list(pool.map(self._request, chunks))
        failures = [reason for _, reason in parts if reason is not None]
        if failures and self.cfg.on_failure == "stop":
            count = sum(len(c) for c, (_, reason) in zip(chunks, parts) if reason is not None)
            raise RewardServiceError(
                f"reward_model.url={self.url!r}: {count} of {n} samples failed after {self.cfg.max_retries + 1} "
                f"attempts ({failures[0]}); fix the service, raise reward_model.remote.timeout_s / max_retries, "
                "or set reward_model.remote.on_failure to zero or skip")
        return [r for results, _ in parts for r in results]


def _prompt_of(extra_info, key):
    """The sample's prompt as written, when the batch carries it (data.return_raw_chat)."""
    prompt = (extra_info or {}).get(key) if isinstance(extra_info, dict) else None
    if isinstance(prompt, (list, tuple)):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return "" if prompt is None else str(prompt)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
