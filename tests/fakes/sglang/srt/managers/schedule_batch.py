"""Test double of the one way sglang's scheduler aborts a request Trident sends.

Mirrors sglang/srt/managers/schedule_batch.py ``ScheduleBatch.retract_decode``: when the decode
batch outgrows the KV pool, requests are retracted and re-run later (invisible to the caller)
until one is left; if even that one cannot grow, it is finished with ``FINISH_ABORT`` ("Out of
memory even after retracting all other requests ...", status 500) and returns the tokens it had
(``FINISH_ABORT.to_json``: type, message, status_code, err_type). The pool holds
``max_total_num_tokens`` = KV bytes // cell size, the cell being kv_heads / tp x (head_dim +
v_head_dim) x layers x the KV dtype's size (sglang/srt/model_executor/pool_configurator.py).
"""
OUT_OF_MEMORY = ("Out of memory even after retracting all other requests in the decode batch. "
                 "Aborting the last request.")
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def max_total_num_tokens(kv_pool_bytes: int, model_path: str, tp: int, dtype: str) -> int:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = max(getattr(c, "num_key_value_heads", None) or c.num_attention_heads, tp) // tp
    cell = kv_heads * 2 * head_dim * c.num_hidden_layers * KV_BYTES.get(dtype, 2)
    return kv_pool_bytes // cell


def fit_to_pool(prompt_len: int, tokens: list, capacity: int):
    """(tokens the request keeps, the abort's finish_reason or None): a request alone in the batch
    holds prompt + generated tokens in the pool; one that needs more is aborted where it stopped."""
    if prompt_len + len(tokens) <= capacity:
        return tokens, None
    kept = tokens[:max(capacity - prompt_len, 0)]
    return kept, {"type": "abort", "message": OUT_OF_MEMORY, "status_code": 500, "err_type": None}
