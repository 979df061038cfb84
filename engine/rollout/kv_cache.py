"""The CPU / hf rollout backends' KV cache (engine/rollout/cpu.py): transformers' cache with
full-attention layers written into buffers sized for the whole generation, the argument name
this transformers takes it under, and the rows that share a prefill (the n samples of a prompt).

Tests: tests/test_rollout_cpu.py
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
                b, h, _, d = key_states.shape
                self._k = key_states.new_empty(b, h, capacity, d)
                self._v = value_states.new_empty(b, h, capacity, value_states.shape[-1])
                self._len = 0
            end = self._len + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"KV cache of {capacity} positions overflowed ({end})")
            self._k[:, :, self._len:end] = key_states
            self._v[:, :, self._len:end] = value_states
            self._len = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        def reorder_cache(self, beam_idx):
            # rows picked (and repeated) along the batch into buffers of the same capacity
            if not self.is_initialized:
                return
            index = beam_idx.to(self._k.device)
            k, v = self._k, self._v
            self._k = k.new_empty(len(index), *k.shape[1:])
            self._v = v.new_empty(len(index), *v.shape[1:])
            self._k[:, :, :self._len] = k[:, :, :self._len].index_select(0, index)
            self._v[:, :, :self._len] = v[:, :, :self._len].index_select(0, index)
            self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]

    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


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
