"""Hybrid engine, rollout side: the training model's weights streamed into a colocated rollout
engine under their HuggingFace names.

`parallel.reshard` turns the training layout into full tensors bucket by bucket (Megatron names);
here each bucket is renamed / split into HF tensors (`engine.models.weights.megatron_to_hf`)
and handed to the rollout group (`engine.rollout.group.GroupedRollout.load_bucket`: inside each
rollout group the members pass handles of their copy to the leader, whose engine loads them), then
`finish_sync` closes the sync. Every rank calls it together (the resharding is collective). A bare
`RolloutEngine` on every rank (tests, R = 1 without a group object) receives the whole model.

Colocation: training and rollout share the device, so the rollout gives its memory back while
training runs (`HybridEngine.to_training`) and takes it again before the weights are sent
(`HybridEngine.to_rollout`).
"""
import time
from dataclasses import dataclass

from engine.models import lora
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


class _Solo:
    """A rollout engine on this rank alone, seen as a group of one."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def begin_sync(self):
        self.engine.begin_weight_update()

    def load_bucket(self, named):
        self.engine.update_weights(named)

    def finish_sync(self):
        self.engine.finish_weight_update()

    def release_memory(self, tags=None):
        self.engine.release_memory(tags)

    def resume_memory(self, tags=None):
        self.engine.resume_memory(tags)


def as_group(rollout):
    return _Solo(rollout) if isinstance(rollout, RolloutEngine) else rollout


def sync_plan(chunks):
    """What `sync_weights` reuses between syncs (collective): a ReshardPlan, or for a LoRA model
    a lora.MergePlan (the base weights are sent merged: W + (alpha / r) B A)."""
    return lora.MergePlan.build(chunks) if lora.spec_of(chunks) else ReshardPlan.build(chunks)


def sync_weights(chunks, rollout, hf_config, bucket_megabytes: float = 512,
                 plan=None) -> SyncStats:
    """Send every weight of the training `chunks` to `rollout` (collective over all ranks): a
    `GroupedRollout`, or a `RolloutEngine` that every rank holds.

    `plan` (a `sync_plan(chunks)` kept from an earlier call) skips the metadata exchange. A LoRA
    model's adapters are merged into the full base tensors bucket by bucket (lora.merged_buckets);
    the merged copy of a weight every rank holds whole (TP = PP = 1) is the only extra memory.
    """
    rollout = as_group(rollout)
    start = time.perf_counter()
    counter = MemoryCounter()
    sent = buckets = 0
    plan = plan or sync_plan(chunks)
    size = _bucket_bytes(bucket_megabytes)
    stream = (lora.merged_buckets(chunks, size, plan, hf_config, counter=counter)
              if isinstance(plan, lora.MergePlan)
              else iter_buckets(chunks, size, plan=plan, counter=counter))
    rollout.begin_sync()
    for bucket in stream:
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        rollout.load_bucket(_to_hf(hf_config, bucket))
        buckets += 1
    rollout.finish_sync()
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

    def __init__(self, chunks, rollout, hf_config, bucket_megabytes: float = 512):
        _bucket_bytes(bucket_megabytes)  # fail at construction, not at the first sync
        self.chunks, self.rollout, self.hf_config = chunks, as_group(rollout), hf_config
        self.bucket_megabytes = bucket_megabytes
        self._plan = None  # ReshardPlan, or lora.MergePlan for a LoRA actor

    def to_rollout(self) -> SyncStats:
        """Collective: take the rollout's memory back and send it the training weights."""
        if self._plan is None:
            self._plan = sync_plan(self.chunks)
        self.rollout.resume_memory()
        return sync_weights(self.chunks, self.rollout, self.hf_config, self.bucket_megabytes,
                            plan=self._plan)

    def to_training(self) -> None:
        """Free the rollout's weights and cache while training runs."""
        self.rollout.release_memory()
