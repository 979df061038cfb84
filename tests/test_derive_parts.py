"""derive()'s four jobs (engine/config/devices.py, inherit.py, steps.py, batches.py) and the step
flags it decides once (`Derived.step`): the flags equal the formula the trainer used to compute
for itself, over configs that flip each input, and nothing else reads the inputs."""
import os
import re

import pytest

from engine.config import derive, load_config
from engine.config.batches import plan_batches
from engine.config.devices import layout_of, training_world
from engine.config.inherit import fill_inherited
from engine.config.steps import StepFlags, needs_old_log_probs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
ONE_MINI = ["actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]


def trainer_formula(cfg, plan):
    """engine/trainer.py's Trainer.__init__ as it computed the flags before Derived.step, with
    the experience source's needs_old_log_probs (engine/experience: truncated IS on; the replay
    source adds ratio > 0)."""
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    full = ("full", "full+")
    needs = alg.rollout_correction.rollout_is is not None or (alg.replay.enable and alg.replay.ratio > 0)
    reuse = (arr.actor.on_policy_old_log_prob and plan.ppo_epochs == 1 and plan.mini_batches_per_epoch == 1
             and not alg.use_kl_in_reward and cfg.trainer.off_policy_steps == 0 and not needs)
    full_kl_in_reward = alg.use_kl_in_reward and alg.kl_penalty in full
    return dict(needs_old_log_probs=needs, reuse_old_log_prob=reuse, full_kl_in_reward=full_kl_in_reward,
                full_kl_in_loss=arr.actor.use_kl_loss and arr.actor.kl_loss_type in full,
                kl_uses_ref=arr.actor.use_kl_loss or alg.use_kl_in_reward,
                keep_ref_hidden=full_kl_in_reward or (arr.actor.use_kl_loss and arr.actor.kl_loss_type in full))


CASES = {  # name -> overrides of the demo recipe
    "demo: 4 mini-batches": [],
    "on-policy": ONE_MINI,
    "on-policy, two epochs": ONE_MINI + ["actor_rollout_ref.actor.ppo_epochs=2"],
    "on-policy turned off": ONE_MINI + ["actor_rollout_ref.actor.on_policy_old_log_prob=false"],
    "in-reward KL": ONE_MINI + ["algorithm.use_kl_in_reward=true"],
    "in-reward exact KL": ONE_MINI + ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full+"],
    "exact KL loss": ONE_MINI + ["actor_rollout_ref.actor.kl_loss_type=full"],
    "no KL at all": ONE_MINI + ["actor_rollout_ref.actor.use_kl_loss=false"],
    "truncated IS": ONE_MINI + ["algorithm.rollout_correction.rollout_is=token"],
    "replayed groups": ONE_MINI + ["algorithm.replay.enable=true", "algorithm.replay.ratio=0.5"],
    "replay filter only": ONE_MINI + ["algorithm.replay.enable=true", "algorithm.replay.ratio=0",
                                      "algorithm.replay.filter=best_worst", "algorithm.replay.keep=0.5"],
    "separate pool, on-policy": ONE_MINI + ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate",
                                            "trainer.rollout_pool_ranks=2"],
    "one-step off-policy pool": ONE_MINI + ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate",
                                            "trainer.rollout_pool_ranks=2", "trainer.off_policy_steps=1"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_step_flags_are_the_trainers_formula(name):
    cfg = load_config(DEMO, CASES[name])
    d = derive(cfg)
    assert isinstance(d.step, StepFlags)
    assert vars(d.step) == trainer_formula(d.config, d.actor), name


def test_the_cases_flip_every_flag():
    seen = {}
    for overrides in CASES.values():
        d = derive(load_config(DEMO, overrides))
        for flag, value in vars(d.step).items():
            seen.setdefault(flag, set()).add(value)
    assert all(values == {True, False} for values in seen.values()), seen


def test_only_the_step_module_reads_what_the_flags_are_made_of():
    """The flags' inputs (on_policy_old_log_prob, the off-policy pool's steps, truncated IS as
    a reason for the old-log-prob pass) are read in engine/config/steps.py only."""
    readers = set()
    pattern = re.compile(r"\.on_policy_old_log_prob\b|\.needs_old_log_probs\b")
    for top in ("engine", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and pattern.search(open(os.path.join(ROOT, path)).read()):
                    readers.add(path)
    assert readers == {"engine/config/steps.py"}


def test_needs_old_log_probs_follows_the_experience_config():
    assert not needs_old_log_probs(load_config(DEMO))
    assert needs_old_log_probs(load_config(DEMO, ["algorithm.rollout_correction.rollout_is=sequence"]))


def test_the_jobs_compose_into_derive():
    tp2 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    cfg = load_config(DEMO, tp2)
    d = derive(cfg, dataset_len=64)
    assert training_world(cfg, None) == 4 and d.layout == layout_of(d.config, 4)
    again = load_config(DEMO, tp2)
    fill_inherited(again)
    assert again.actor_rollout_ref.ref.megatron == d.config.actor_rollout_ref.ref.megatron
    batches = plan_batches(d.config, d.layout.dp)
    assert batches["actor"] == d.actor and batches["forward"] == d.forward
    assert batches["rollout_batch_size_per_rank"] == d.rollout_batch_size_per_rank == 32 * 8 // 2
