"""The CPU / hf rollout backends' KV caches (engine/rollout/cpu.py), both buffers sized for the
whole generation and written in place (`write_kv`, `reorder_kv`): transformers' cache with such
full-attention layers, and LeanCache for engine/rollout/lean_decode.py's forward; the argument
name this transformers takes its cache under, and the rows that share a prefill (the n samples
of a prompt).

Tests: tests/test_rollout_cpu.py, tests/test_lean_decode.py
"""
import functools
import inspect



@functools.lru_cache(maxsize=None)
def cache_argument(model_class) -> str:
    """The forward's KV-cache argument: `cache` in newer transformers (5.24 here; it still maps
    `past_key_values` with a deprecation warning), `past_key_values` in older ones (5.17, the
    GPU machine's), which have no `cache` parameter."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def write_kv(store, k, v, start: int, capacity: int):
    """k, v [rows, kv heads, new, head dim] into `store`, (keys, values) buffers of `capacity`
    positions (None: made at this first write), at positions start..; returns (store, keys so
    far, values so far)."""
    end = start + k.shape[2]
    if end > capacity:
        raise RuntimeError(f"KV cache of {capacity} positions overflowed ({end})")
    if store is None:
        store = (k.new_empty(*k.shape[:2], capacity, k.shape[3]),
                 v.new_empty(*v.shape[:2], capacity, v.shape[3]))
    store[0][:, :, start:end] = k
    store[1][:, :, start:end] = v
    return store, store[0][:, :, :end], store[1][:, :, :end]


def reorder_kv(store, index):
    """Rows of (keys, values) buffers picked (and repeated) along the batch: the n samples of a
    prompt share its prefill (engine/rollout/cpu.py)."""
    return tuple(buf.index_select(0, index.to(buf.device)) for buf in store)


def preallocated_cache(config, capacity: int):
    """transformers' DynamicCache whose full-attention layers write into buffers sized for the
    whole generation: its default layers grow by concatenation, copying the cache at every
    decoded token (a fifth of a small model's generation time here)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._store, self._len = None, 0
            self._store, self.keys, self.values = write_kv(self._store, key_states, value_states,
                                                           self._len, capacity)
            self._len += key_states.shape[-2]
            return self.keys, self.values

        def reorder_cache(self, beam_idx):
            if self.is_initialized:
                self._store = reorder_kv(self._store, beam_idx)
                self.keys, self.values = (buf[:, :, :self._len] for buf in self._store)

    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


class LeanCache:
    """The KV cache of engine/rollout/lean_decode.py's forward: every layer's (keys, values)
    buffers sized for the whole generation, written in place; `length` positions held."""

    def __init__(self, layers: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.stores: list = [None] * layers

    def write(self, layer: int, k, v, start: int):
        """k, v [rows, kv heads, new, head dim] at positions start..; the layer's keys and values
        so far."""
        self.stores[layer], keys, values = write_kv(self.stores[layer], k, v, start, self.capacity)
        return keys, values

    def reorder_cache(self, index):
        self.stores = [None if s is None else reorder_kv(s, index) for s in self.stores]


def distinct_rows(rows):
    """([the first row of each distinct token list], [each row's index into that list])."""
    seen, firsts, inverse = {}, [], []
    for r, tokens in enumerate(rows):
        key = tuple(tokens)
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(r)
        inverse.append(seen[key])
    return firsts, inverse
