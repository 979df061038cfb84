"""Validation of where a PPO step's experience comes from and how it is weighed: logged
responses (data.offline_path), token-level model rewards, rollout correction (IS, rejection, veto),
replay / PF-PPO and DAPO dynamic sampling. One ConfigError naming key, value and fix each.

Tests: tests/test_experience_parts.py, tests/test_rollout_correction.py, tests/test_replay_dynamic.py,
tests/test_token_rewards.py, tests/test_streaming.py
"""
from __future__ import annotations

from engine.algorithms.correction import plan_of
from engine.config.schema import ConfigError, FilterGroupsConfig, ReplayConfig, TridentConfig
from engine.config.checks import check_range, fail


def validate_experience(cfg: TridentConfig) -> None:
    from engine.config.validate_sources import validate_sources  # data classes, reward services
    validate_sources(cfg)
    _offline_source(cfg)
    _partial_rollout(cfg)  # the separate pool's (tests/test_staleness.py)
    from engine.config.validate_pool import validate_pool  # restarting its ranks
    validate_pool(cfg)
    _model_rewards(cfg)
    rc = cfg.algorithm.rollout_correction
    try:
        plan_of(rc)
    except ValueError as e:  # its messages name the key, the value and the fix
        raise ConfigError(str(e)) from None
    _replay(cfg)
    _filter_groups(cfg)
    _streaming(cfg)
    if cfg.trainer.rollout_pool == "separate" and cfg.data.offline_path is not None:
        fail("data.offline_path", cfg.data.offline_path, "logged responses need no rollout pool: "
             "set trainer.rollout_pool=colocated or remove data.offline_path")
    if cfg.trainer.task != "ppo":  # the offline trainers of engine/offline read none of these
        for key, set_ in (("data.offline_path", cfg.data.offline_path is not None),
                          ("reward_model.token_level", cfg.reward_model.token_level is not None),
                          *((f"algorithm.rollout_correction.{k}", getattr(rc, k) is not None)
                            for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")),
                          ("algorithm.rollout_correction.bypass_mode", rc.bypass_mode),
                          ("algorithm.replay.enable", cfg.algorithm.replay.enable),
                          ("algorithm.filter_groups.enable", cfg.algorithm.filter_groups.enable),
                          ("trainer.balance_batch", cfg.trainer.balance_batch)):
            if set_:
                fail(key, _value(cfg, key), f"a PPO key; trainer.task={cfg.trainer.task!r} trains "
                     "offline (no rollout); remove it")


def _value(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _streaming(cfg: TridentConfig) -> None:
    """data.gen_batch_size (verl's DAPO name): prompts the separate pool is asked for per
    generation batch, more than a step trains (engine/experience/streaming.py)."""
    d, t = cfg.data, cfg.trainer
    check_range(d, "data", "gen_batch_size", ge=1, optional=True)
    if d.gen_batch_size is None or d.gen_batch_size == d.train_batch_size:
        return
    if t.rollout_pool != "separate":
        fail("data.gen_batch_size", d.gen_batch_size, "over-sampling is read by the separate rollout pool "
             "only (trainer.rollout_pool=separate); remove it or set it to data.train_batch_size")
    if d.gen_batch_size < d.train_batch_size:
        fail("data.gen_batch_size", d.gen_batch_size, f"asks for fewer prompts than a step trains "
             f"(data.train_batch_size={d.train_batch_size}); use >= {d.train_batch_size} or remove it")
    if t.off_policy_steps == 0 and not cfg.algorithm.filter_groups.enable:
        fail("data.gen_batch_size", d.gen_batch_size, "with trainer.off_policy_steps=0 every surplus group "
             "is a version old at the next step and would be dropped; set off_policy_steps >= 1, enable "
             "algorithm.filter_groups, or remove it")


def _offline_source(cfg: TridentConfig) -> None:
    d, alg, rm = cfg.data, cfg.algorithm, cfg.reward_model
    if d.offline_path is None:
        return
    where = "data.offline_path is set: the logged responses and rewards are the experience"
    if d.train_files or d.builtin_task is not None:
        key, value = (("data.train_files", d.train_files) if d.train_files
                      else ("data.builtin_task", d.builtin_task))
        fail(key, value, f"{where}, so use one source: remove {key} (held-out prompts go in data.val_files)")
    refused = [("algorithm.adv_estimator", alg.adv_estimator, alg.adv_estimator == "remax",
                "ReMax generates a greedy baseline; use grpo, rloo, gae or reinforce_plus_plus"),
               ("algorithm.filter_groups.enable", True, alg.filter_groups.enable,
                "dynamic sampling generates more responses; remove it"),
               ("reward_model.enable", True, rm.enable, "no reward is computed; remove it"),
               ("reward_model.rule_reward", False, not rm.rule_reward, "no reward is computed; remove it"),
               ("reward_model.overlong_buffer.enable", True, rm.overlong_buffer.enable,
                "no reward is computed; shape the logged rewards instead"),
               ("custom_reward_function.path", cfg.custom_reward_function.path,
                cfg.custom_reward_function.path is not None, "no reward is computed; remove it")]
    for key, value, bad, fix in refused:
        if bad:
            fail(key, value, f"{where} (no generation); {fix}")


def _model_rewards(cfg: TridentConfig) -> None:
    rm = cfg.reward_model
    if rm.token_level is not None and not rm.enable:
        fail("reward_model.token_level", rm.token_level, "spreads the reward model's reward over "
             "tokens; set reward_model.enable=true and reward_model.model.path (margin: a reward "
             "model, implicit: a DPO policy), or remove it")
    if not rm.rule_reward and not rm.enable and cfg.data.offline_path is None:
        fail("reward_model.rule_reward", False, "without the rule reward and without a reward model "
             "nothing scores the responses; set reward_model.enable=true or rule_reward=true")


def _replay(cfg: TridentConfig) -> None:
    r, p = cfg.algorithm.replay, "algorithm.replay"
    check_range(r, p, "capacity", ge=1)
    check_range(r, p, "ratio", ge=0.0)
    check_range(r, p, "keep", gt=0.0, le=1.0)
    check_range(r, p, "weight_pow", ge=0.0)
    default = ReplayConfig()
    if not r.enable:
        for name in ("capacity", "ratio", "filter", "keep", "weight_pow"):
            if getattr(r, name) != getattr(default, name):
                fail(f"{p}.{name}", getattr(r, name),
                     f"read only with {p}.enable=true; set it or remove this key")
        return
    if r.ratio == 0 and r.filter is None:
        fail(f"{p}.enable", True, f"with {p}.ratio=0 and no {p}.filter the buffer changes nothing; "
             "set ratio > 0 (replayed groups per fresh group) or a PF-PPO filter")
    n = cfg.actor_rollout_ref.rollout.n
    if r.filter in ("best", "best_worst"):
        kept, least = round(r.keep * n), 1 if r.filter == "best" else 2
        if kept < least:
            fail(f"{p}.keep", r.keep, f"keeps round({r.keep} x rollout.n {n}) = {kept} responses per "
                 f"prompt; filter={r.filter!r} needs at least {least}: raise keep or rollout.n")
    elif r.keep != default.keep:
        fail(f"{p}.keep", r.keep,
             f"read by filter 'best' / 'best_worst' only (filter={r.filter!r}); remove it")
    if r.filter != "reweight" and r.weight_pow != default.weight_pow:
        fail(f"{p}.weight_pow", r.weight_pow,
             f"read by filter 'reweight' only (filter={r.filter!r}); remove it")


def _filter_groups(cfg: TridentConfig) -> None:
    f, p = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    check_range(f, p, "max_num_gen_batches", ge=0)
    if not f.enable:
        default = FilterGroupsConfig()
        for name in ("metric", "max_num_gen_batches"):
            if getattr(f, name) != getattr(default, name):
                fail(f"{p}.{name}", getattr(f, name),
                     f"read only with {p}.enable=true; set it or remove this key")
        return
    n = cfg.actor_rollout_ref.rollout.n
    if n < 2:
        fail("actor_rollout_ref.rollout.n", n, f"{p}.enable=true drops prompts whose responses all score "
             "the same, which a single response always does; set rollout.n >= 2")
    if not f.metric:
        fail(f"{p}.metric", f.metric, "name what must differ within a group: seq_reward, "
             "seq_final_reward or a reward extra such as acc")
    if f.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        fail(f"{p}.metric", f.metric, "groups are filtered before the in-reward KL is known here "
             "(algorithm.use_kl_in_reward=true); use seq_reward")


def _partial_rollout(cfg: TridentConfig) -> None:
    """trainer.partial_rollout: the separate pool's engines pause for new weights mid-generation
    (engine/rollout/pool.py serve); only where that can happen and the pool can drive it."""
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    if not t.partial_rollout:
        return
    if t.rollout_pool != "separate" or t.off_policy_steps < 1:
        fail("trainer.partial_rollout", True, "weights arrive during a generation only when a separate pool "
             "works ahead: set trainer.rollout_pool=separate and off_policy_steps >= 1, or remove it")
    # an SGLang engine is driven by its group's leader alone; cpu / hf groups of TP > 1 decode together
    tp_ok = r.name == "sglang" or r.tensor_model_parallel_size == 1
    if r.name not in ("cpu", "hf", "sglang") or not tp_ok or r.multi_turn.enable:
        fail("trainer.partial_rollout", True, f"the pool pauses and continues engines of the cpu / hf backends "
             f"at rollout TP 1 and sglang, single-turn, so far (rollout.name={r.name!r}, "
             f"tensor_model_parallel_size={r.tensor_model_parallel_size}); remove it")
    if cfg.actor_rollout_ref.actor.router_replay:  # the engines refuse it at the first continuation
        fail("trainer.partial_rollout", True, "a continued response's expert routing is not recorded (the new "
             "weights would route its old tokens): set actor_rollout_ref.actor.router_replay=false or remove it")
