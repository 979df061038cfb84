"""Hybrid engine, rollout side: the training model's weights streamed into a colocated rollout
engine under their HuggingFace names.

`parallel.reshard` turns the training layout into full tensors bucket by bucket (Megatron names);
here each bucket is renamed / split into HF tensors (`engine.models.weights.megatron_to_hf`)
and handed to `rollout.update_weights`, then `finish_weight_update` closes the sync. Every rank
calls it together (the resharding is collective); every rank's rollout engine gets the whole
model.

Colocation: training and rollout share the device, so the rollout gives its memory back while
training runs (`HybridEngine.to_training`) and takes it again before the weights are sent
(`HybridEngine.to_rollout`).
"""
import time
from dataclasses import dataclass
from typing import Optional

from engine.models.weights import megatron_to_hf
from engine.rollout.base import RolloutEngine
from parallel.reshard import MemoryCounter, ReshardPlan, iter_buckets


@dataclass(frozen=True)
class SyncStats:
    bytes: int        # bytes of full tensors sent to the rollout engine
    buckets: int
    seconds: float
    peak_bytes: int   # most bytes resharding held at once on this rank (at most one bucket)

    def metrics(self):
        return {"timing_s/update_weights": self.seconds,
                "perf/update_weights_gb": self.bytes / 1e9,
                "perf/update_weights_buckets": self.buckets}


def _bucket_bytes(bucket_megabytes):
    if not bucket_megabytes or bucket_megabytes <= 0:
        raise ValueError(f"bucket_megabytes={bucket_megabytes!r}: the weight-sync bucket must be a "
                         f"positive size in MiB (e.g. 512)")
    return max(1, int(bucket_megabytes * (1 << 20)))


def _to_hf(hf_config, bucket):
    """The bucket under HF names. Where the HF tensors are copies (split QKV, gate / up) the
    fused tensor is dropped as soon as it is split, so the bucket is not held twice."""
    named = []
    for i in range(len(bucket)):
        name, tensor = bucket[i]
        bucket[i] = None
        named += megatron_to_hf(hf_config, name, tensor)
    return named


def sync_weights(chunks, rollout: RolloutEngine, hf_config, bucket_megabytes: float = 512,
                 plan: Optional[ReshardPlan] = None) -> SyncStats:
    """Send every weight of the training `chunks` to `rollout` (collective over all ranks).

    `plan` (a `ReshardPlan.build(chunks)` kept from an earlier call) skips the metadata exchange.
    """
    start = time.perf_counter()
    counter = MemoryCounter()
    sent = buckets = 0
    for bucket in iter_buckets(chunks, _bucket_bytes(bucket_megabytes), plan=plan, counter=counter):
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        rollout.update_weights(_to_hf(hf_config, bucket))
        buckets += 1
    rollout.finish_weight_update()
    return SyncStats(bytes=sent, buckets=buckets, seconds=time.perf_counter() - start,
                     peak_bytes=counter.peak)


class HybridEngine:
    """Training chunks and a rollout engine sharing one device, switching between phases.

        engine = HybridEngine(chunks, rollout, hf_config, bucket_megabytes=512)
        stats = engine.to_rollout()    # resume the rollout's memory, send the current weights
        out = rollout.generate(...)
        engine.to_training()           # the rollout gives its weights and KV cache back

    The reshard plan is built on the first sync and kept: the layout does not change.
    """

    def __init__(self, chunks, rollout: RolloutEngine, hf_config, bucket_megabytes: float = 512):
        _bucket_bytes(bucket_megabytes)  # fail at construction, not at the first sync
        self.chunks, self.rollout, self.hf_config = chunks, rollout, hf_config
        self.bucket_megabytes = bucket_megabytes
        self._plan: Optional[ReshardPlan] = None

    def to_rollout(self) -> SyncStats:
        """Collective: take the rollout's memory back and send it the training weights."""
        if self._plan is None:
            self._plan = ReshardPlan.build(self.chunks)
        self.rollout.resume_memory()
        return sync_weights(self.chunks, self.rollout, self.hf_config, self.bucket_megabytes,
                            plan=self._plan)

    def to_training(self) -> None:
        """Free the rollout's weights and cache while training runs."""
        self.rollout.release_memory()
