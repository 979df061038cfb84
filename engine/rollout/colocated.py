"""The colocated hand-off (the hybrid engine, rollout side): the training model's weights streamed
into a rollout engine on the same devices under their HuggingFace names, and the rollout's memory
moved as the memory schedule says.

`parallel.reshard` turns the training layout into full tensors bucket by bucket (Megatron names);
here each bucket is renamed / split into HF tensors (`engine.models.weights.megatron_to_hf`)
and handed to the rollout group (`engine.rollout.group.GroupedRollout.load_bucket`: inside each
rollout group the members pass handles of their copy to the leader, whose engine loads them), then
`finish_sync` closes the sync. Every rank calls it together (the resharding is collective). A bare
`RolloutEngine` on every rank (tests, R = 1 without a group object) receives the whole model.

Colocation: training and rollout share the device, so the rollout gives its memory back while
training runs (`HybridEngine.to_training`) and takes it again before the weights are sent
(`HybridEngine.to_rollout`). Storage that training offloads goes to torch's caching allocator;
before the rollout (other processes) resumes anything, `parallel.device_memory.return_to_device`
hands it to the device. SGLang sizes its KV pool from the memory free when the engine starts, so
engine/train.py builds the engines before the training models and `hand_back` releases them.

`bucket_bytes` and `to_hf_names` are shared with the separate pool (engine/rollout/pool.py), which
sends the same buckets to other ranks. The schedule object comes from the config layer above
(engine/config/phases.py); this module only reads its `rollout(phase)` and `resident(phase, model)`.

Tests: tests/test_reshard.py, tests/test_device_memory.py, tests/test_lora.py, tests/test_router_replay.py,
tests/test_rollout_groups.py
"""
import time
import weakref
from dataclasses import dataclass
from typing import Optional

from engine.models import lora
from engine.models.weights import megatron_to_hf
from engine.rollout.base import ROLLOUT_MEMORY, RolloutEngine
from engine.rollout.delivery import Delivery, transfer_plan_for
from parallel import device_memory, fsdp
from parallel.reshard import MemoryCounter, ReshardPlan, iter_buckets


@dataclass(frozen=True)
class SyncStats:
    bytes: int        # bytes of full tensors sent to the rollout engine
    buckets: int
    seconds: float
    peak_bytes: int   # most bytes resharding held at once on this rank (at most one bucket)

    def metrics(self):
        """What a step logs of its sync (the phase times it)."""
        return {"perf/update_weights_gb": self.bytes / 1e9}


def bucket_bytes(bucket_megabytes) -> int:
    """The weight-sync bucket size in bytes (`update_weights_bucket_megabytes` MiB); refuses a
    size that is not positive."""
    if not bucket_megabytes or bucket_megabytes <= 0:
        raise ValueError(f"bucket_megabytes={bucket_megabytes!r}: the weight-sync bucket must be a "
                         f"positive size in MiB (e.g. 512)")
    return max(1, int(bucket_megabytes * (1 << 20)))


def to_hf_names(hf_config, bucket):
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
        self.loads_slices, self.whole_tensors = engine.LOADS_SLICES, False

    def begin_sync(self):
        self.engine.begin_weight_update()

    def load_bucket(self, named):
        self.engine.update_weights(named)

    def load_slices(self, pieces, tensors, dtype=None, device=None):
        self.engine.load_slices(pieces)

    def finish_sync(self):
        self.engine.finish_weight_update()

    def release_memory(self, tags=None):
        self.engine.release_memory(tags)

    def resume_memory(self, tags=None):
        self.engine.resume_memory(tags)

    def barrier(self):  # a group of one waits for no one
        pass


def as_group(rollout):
    """A rollout group (or None: the rollout lives on other ranks, a separate pool)."""
    return _Solo(rollout) if isinstance(rollout, RolloutEngine) else rollout


_RELEASED = weakref.WeakSet()  # engines given back by hand_back: a HybridEngine starts with none of their memory


def hand_back(rollout) -> None:
    """Collective: an engine just built on a device training has not used yet gives all its memory
    back (weights, KV cache, CUDA graphs) before the training models are placed; every rank of its
    group waits, so no rank allocates while an engine's worker on its GPU still holds its share."""
    group = as_group(rollout)
    group.release_memory(None)
    _RELEASED.add(rollout)
    group.barrier()


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
    size = bucket_bytes(bucket_megabytes)
    stream = (lora.merged_buckets(chunks, size, plan, hf_config, counter=counter)
              if isinstance(plan, lora.MergePlan)
              else iter_buckets(chunks, size, plan=plan, counter=counter))
    rollout.begin_sync()
    for bucket in stream:
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        rollout.load_bucket(to_hf_names(hf_config, bucket))
        buckets += 1
    rollout.finish_sync()
    return SyncStats(bytes=sent, buckets=buckets, seconds=time.perf_counter() - start,
                     peak_bytes=counter.peak)


class HybridEngine:
    """Executes the memory schedule (engine/config/phases.py) of training models colocated with
    a rollout engine: `sync()` runs the colocated sync in its order and leaves the rollout ready
    to generate; `enter(phase)` puts each model's states and the rollout's memory where the
    schedule says for that phase.

        engine = HybridEngine(chunks, rollout, hf_config, 512, schedule, {"actor": actor, ...})
        stats = engine.sync()          # grads/optimizer off, weights in, params off, KV cache on
        out = rollout.generate(...)
        engine.enter("update_actor")   # the rollout gives its memory back, the actor's state returns

    Without a schedule (tests) there are no training models to move and the rollout takes its
    weights, then its KV cache, for a sync and gives both back on `to_training()`. The reshard
    plan is built on the first sync and kept: the layout does not change. With `record` set,
    every phase appends each model's resident bytes and the rollout's memory to `log`.
    """

    def __init__(self, chunks, rollout, hf_config, bucket_megabytes: float = 512, schedule=None,
                 workers: Optional[dict] = None, layout=None, topology=None):
        bucket_bytes(bucket_megabytes)  # fail at construction, not at the first sync
        self.chunks, self.rollout, self.hf_config = chunks, as_group(rollout), hf_config
        self.bucket_megabytes = bucket_megabytes
        # the transfer plan's delivery (engine/rollout/delivery.py) where it applies: the
        # training layout and rollout topology known, a backend loading slices, no LoRA merge
        self.planned = (layout is not None and topology is not None and self.rollout is not None
                        and getattr(self.rollout, "loads_slices", False) and not lora.spec_of(chunks)
                        and (not isinstance(self.rollout, _Solo) or topology.tp == 1))
        self.layout, self.topology = layout, topology
        self.schedule, self.workers = schedule, dict(workers or {})
        if schedule is not None and set(self.workers) != set(schedule.models):
            raise ValueError(f"workers {sorted(self.workers)} do not match the schedule's models "
                             f"{sorted(schedule.models)}")
        self._plan = None  # ReshardPlan, or lora.MergePlan for a LoRA actor
        # an engine starts with its memory taken, unless hand_back gave it back
        self.rollout_memory = set() if rollout in _RELEASED else set(ROLLOUT_MEMORY)
        self.record, self.log = False, []
        self.phase = None  # the phase whose memory is in place (None: not known)

    def _rollout_wanted(self, phase):
        if self.schedule is not None:
            return set(self.schedule.rollout(phase))
        return {"weights"} if phase == "update_weights" else set(ROLLOUT_MEMORY) if phase == "gen" else set()

    def plan(self):
        """Built on first use and kept: the planned delivery (a delivery.Delivery), else the
        reshard plan (collective), or a lora.MergePlan for a LoRA actor (a separate pool's send
        merges with it too: engine/rollout/pool.py `buckets`)."""
        if self._plan is None:
            if self.planned:
                plan = transfer_plan_for(self.hf_config, self.layout, self.topology, self.chunks,
                                         self.bucket_megabytes)
                self._plan = Delivery(plan, self.chunks, whole_tensors=self.rollout.whole_tensors)
            else:
                self._plan = sync_plan(self.chunks)
        return self._plan

    def _rollout_to(self, wanted):
        if self.rollout is None:  # a separate pool: nothing of the rollout on these devices
            return
        gone = self.rollout_memory - wanted
        if gone:
            self.rollout.release_memory(sorted(gone))
        for tag in ROLLOUT_MEMORY:  # weights before the KV cache
            if tag in wanted and tag not in self.rollout_memory:
                # what training freed is torch's cache until handed back to the device; every rank
                # of the group hands it back before the leader's engine resumes on the group's
                # GPUs, and waits until it has (collective within the group: GPUs of other
                # groups hold none of this engine's memory)
                device_memory.return_to_device()
                self.rollout.barrier()
                self.rollout.resume_memory([tag])
                self.rollout.barrier()
        self.rollout_memory = set(wanted)

    def _models_to(self, phase):
        for name, worker in self.workers.items():
            worker.set_resident(self.schedule.resident(phase, name))

    def _note(self, phase):
        if self.record:
            self.log.append(dict(phase=phase, rollout=sorted(self.rollout_memory),
                                 models={n: w.resident_bytes() for n, w in self.workers.items()},
                                 device=dict(reserved=device_memory.reserved(), free=device_memory.free())))

    def enter(self, phase: str) -> None:
        """Move memory to what `phase` needs (not 'update_weights': use `sync()`)."""
        if phase == "update_weights":
            raise ValueError("the sync phase runs in an order of its own: call sync()")
        if phase == self.phase:  # already there (generation right after the sync)
            return
        self.phase = phase
        if self.workers:
            self._models_to(phase)
        self._rollout_to(self._rollout_wanted(phase))
        self._note(phase)

    def sync(self) -> SyncStats:
        """Collective: the colocated sync (phases.SYNC_ORDER); ends ready to generate."""
        self.plan()
        self.phase = None  # memory moves in the sync's own order
        if self.workers:
            self._models_to("update_weights")  # training grads and optimizer state leave first
        self._rollout_to(self._rollout_wanted("update_weights"))  # the rollout's weights memory
        with fsdp.gathered(self.chunks):  # a fully sharded model's full values (parallel/fsdp.py)
            if self.planned:
                stats = self._plan.run(self.rollout)
            else:
                stats = sync_weights(self.chunks, self.rollout, self.hf_config,
                                     self.bucket_megabytes, plan=self._plan)
        self._note("update_weights")
        if self.workers:
            self._models_to("gen")  # the actor's parameters leave (param_offload)
        self._rollout_to(self._rollout_wanted("gen"))  # then the KV cache comes back
        self._note("gen")
        self.phase = "gen"
        return stats

    def rollout_ready(self) -> bool:
        """Whether the rollout holds its weights and KV cache (ready to generate)."""
        return self.rollout is None or self.rollout_memory == set(ROLLOUT_MEMORY)

    def to_rollout(self) -> SyncStats:
        return self.sync()

    def to_training(self) -> None:
        """Free the rollout's weights and cache (no schedule: nothing else moves)."""
        self.phase = None
        self._rollout_to(set())
