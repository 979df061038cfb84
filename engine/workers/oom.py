"""Out-of-memory back-off that every rank agrees on, whatever the layout.

An update's micro-batches run in lock step on the ranks of one pipeline stage (TP and CP peers
hold the same micro-batch and meet in its collectives; with EP the DP ranks meet in the MoE
layers too), and the stages meet in the pipeline's send / receive. A rank that simply raised
out of the schedule would leave its peers waiting in those collectives. So, when the update
may retry (`trainer.oom_retry` > 0):

* before each micro-batch, the stage's lock-step peers all-reduce a flag "a micro-batch of mine
  ran out of memory" (one float);
* once it is set, they run *idle* micro-batches for the rest of the attempt: an output of the
  shape the pipeline expects (zeros, joined to the received activations so gradients flow back
  to the previous stage), no model forward, a zero loss — every send / receive still happens;
* after the schedule, parallel.schedule.forward_backward all-reduces the flag over every rank
  and all raise MicroBatchOOM together; engine/workers/template.py retries the mini-batch at
  half the micro-batch on every rank and keeps that size.

Where it agrees: an out-of-memory found at a micro-batch's start (the injected fault of
engine/faults.py; on a GPU, torch raises where an allocation fails, which may be inside a
forward's TP collectives — that one still leaves its peers waiting until the collective timeout
ends the job, with the phase and collective named, engine/guards.py CollectiveWatch).

Tests: tests/test_faults.py
"""
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine import faults


def lock_step_groups():
    """The groups whose ranks run this stage's micro-batches together (every rank of the stage
    is reached: TP, then CP, then with EP the DP x CP ranks)."""
    groups = [ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()]
    if ps.get_expert_model_parallel_world_size() > 1:
        groups.append(ps.get_data_parallel_group(with_context_parallel=True))
    return [g for g in groups if dist.get_world_size(g) > 1]


class OOMAgreement:
    """One update attempt's out-of-memory state on this rank (see the module docstring)."""

    def __init__(self, worker):
        self.worker = worker
        self.oom: Optional[BaseException] = None
        self.groups = lock_step_groups()

    def idles(self, at: int) -> bool:
        """Whether micro-batch `at` (of this attempt) must run idle on this rank: this rank or a
        lock-step peer ran out of memory in it or an earlier one. Collective over the peers."""
        if self.oom is None and faults.fault("oom", model=self.worker.name, micro=at):
            self.oom = faults.SimulatedOOM(f"injected out of memory in micro-batch {at}")
        flag = torch.tensor([0.0 if self.oom is None else 1.0])  # CPU: the groups' gloo half
        for group in self.groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() > 0 and self.oom is None:
            self.oom = MemoryError(f"out of memory on a model-parallel peer (micro-batch {at})")
        return flag.item() > 0

    def recorded(self) -> Optional[BaseException]:
        return self.oom

    def idle_step(self, model, mb):
        """(output, loss_fn) of an idle micro-batch: what the next stage (or the loss) expects
        in shape, zero in value, with no model forward."""
        worker = self.worker
        inner = getattr(model, "module", model)
        received = getattr(getattr(inner, "decoder", None), "input_tensor", None)
        if received is not None:  # a later stage: keep the gradient path to the previous one
            out = received * 0.0
        elif not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=getattr(inner, "vp_stage", None)):
            sp = worker.config.sequence_parallel
            tp = ps.get_tensor_model_parallel_world_size() if sp else 1
            b, s = mb.tokens.shape  # packed: [1, T]; this CP rank's share already
            dtype = worker.config.pipeline_dtype or worker.params_dtype
            out = torch.zeros(s // tp, b, worker.config.hidden_size, dtype=dtype, device=worker.device,
                              requires_grad=True)
        else:  # one stage: only the loss follows
            out = torch.zeros(1, device=worker.device, requires_grad=True)

        def loss_fn(output):
            return output.sum() * 0.0, torch.tensor(1), {"idle": True}
        return out, loss_fn
