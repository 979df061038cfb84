"""Never lose a run: what the users' runbooks do by hand, done by the trainer.

* `StepGuard` (non-finite values): a step whose rewards hold NaN / Inf trains nothing; an
  optimizer step whose gradients do is skipped on every rank (engine/workers/base.py); after
  `trainer.max_nonfinite_skips` consecutive steps that applied nothing, the run rolls back to
  the last good checkpoint with the LR multiplied by `trainer.rollback_lr_factor` (and without
  one, lowers the LR in place: the weights are still the last good ones, nothing bad was
  applied). Counts and the LR scale are trainer state, saved and restored.
* Out-of-memory back-off (`trainer.oom_retry`): the ranks of a pipeline stage agree before each
  micro-batch whether one ran out of memory, idle together through the rest of the attempt so
  no peer waits in a collective, and every rank retries the mini-batch at half the micro-batch
  (engine/workers/oom.py, parallel/schedule.py, engine/workers/template.py).
* `CollectiveWatch` (hangs): every torch.distributed collective runs under the process group's
  timeout (`trainer.collective_timeout_s`); the watch remembers the phase and the collective in
  flight, so when one fails (a peer died or stopped answering) the job ends with one line naming
  the rank, the phase and the collective, instead of hanging or dumping every rank's stack.

Tests: tests/test_faults.py, tests/test_guard_rewards.py
"""
import functools

import torch
import torch.distributed as dist


MAX_ROLLBACKS = 3  # a run that stays non-finite after this many rollbacks needs a person


class StepGuard:
    def __init__(self, max_skips, lr_factor):
        self.max_skips, self.lr_factor = max_skips, lr_factor
        self.skipped_steps = 0     # optimizer steps skipped (all models, all time)
        self.consecutive = 0       # PPO steps in a row that applied no update
        self.rollbacks = 0
        self.lr_scale = 1.0

    @staticmethod
    def finite(tensor) -> bool:
        """Whether `tensor` is finite on every rank (collective)."""
        flag = torch.tensor([0.0 if bool(torch.isfinite(tensor).all()) else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def after_step(self, metrics, applied_any):
        """Account one PPO step; returns True when the run must roll back now."""
        self.skipped_steps += int(sum(v for k, v in metrics.items() if k.endswith("/skipped_updates")))
        self.consecutive = 0 if applied_any else self.consecutive + 1
        metrics.update({"train/skipped_steps": float(self.skipped_steps),
                        "train/nonfinite_streak": float(self.consecutive),
                        "train/rollbacks": float(self.rollbacks), "train/lr_scale": self.lr_scale})
        return self.consecutive >= self.max_skips

    def lower_lr(self, workers):
        """Scale every optimizer's LR (and its schedule) by `lr_factor`; returns the new scale."""
        if self.rollbacks >= MAX_ROLLBACKS:
            raise RuntimeError(f"the run stayed non-finite after {self.rollbacks} rollbacks (LR x{self.lr_scale:g}): "
                               "stopping; the last good checkpoint is kept. Check the data and rewards, or "
                               "lower actor_rollout_ref.actor.optim.lr")
        self.lr_scale *= self.lr_factor
        self.rollbacks += 1
        self.consecutive = 0
        for worker in workers:
            scale_lr(worker, self.lr_factor)
        return self.lr_scale

    def state_dict(self):
        return dict(skipped_steps=self.skipped_steps, consecutive=self.consecutive,
                    rollbacks=self.rollbacks, lr_scale=self.lr_scale)

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def scale_lr(worker, factor):
    """Multiply a worker's learning rate, now and for the rest of its schedule."""
    sched = worker.scheduler
    for name in ("init_lr", "max_lr", "min_lr"):
        if hasattr(sched, name):
            setattr(sched, name, getattr(sched, name) * factor)
    for group in worker.optimizer.param_groups:
        group["lr"] *= factor
        for key in ("max_lr", "min_lr"):
            if key in group and group[key] is not None:
                group[key] *= factor


class CollectiveWatch:
    """Remembers the trainer's phase and the collective in flight (see the module docstring)."""

    OPS = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
           "broadcast_object_list", "reduce_scatter_tensor", "barrier", "send", "recv", "gather_object",
           "all_to_all_single")

    def __init__(self):
        self.phase, self.collective, self.failed = "startup", None, None
        self._originals = {}

    def install(self):
        for op in self.OPS:
            fn = getattr(dist, op, None)
            if fn is None or op in self._originals:
                continue
            self._originals[op] = fn
            setattr(dist, op, self._wrap(op, fn))
        return self

    def uninstall(self):
        for op, fn in self._originals.items():
            setattr(dist, op, fn)
        self._originals.clear()

    def _wrap(self, op, fn):
        @functools.wraps(fn)
        def watched(*args, **kwargs):
            previous, self.collective = self.collective, op
            try:
                return fn(*args, **kwargs)
            except Exception:
                self.failed = self.failed or (op, self.phase)  # the first one to fail is the story
                raise
            finally:
                self.collective = previous
        return watched

    def describe(self, error, timeout_s):
        rank = dist.get_rank() if dist.is_initialized() else 0
        op, phase = self.failed or (self.collective, self.phase)
        where = f"in {op}" if op else "in a collective"
        return (f"rank {rank}: {where} during phase '{phase}' another rank did not answer within "
                f"trainer.collective_timeout_s={timeout_s} (or left the job): {str(error).splitlines()[0][:300]}; "
                f"the job ends here. Check that rank's log first")


def is_collective_failure(error) -> bool:
    """A torch.distributed failure (timeout, a peer gone), not a bug of ours."""
    names = {type(e).__name__ for e in (error, error.__cause__) if e is not None}
    if names & {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}:
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("timed out", "timeout", "connection closed", "connection reset",
                            "broken pipe", "peer", "gloo"))
