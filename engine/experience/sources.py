"""The registry of experience sources and the one a config picks (engine/experience/base.py
defines the interface).

    online             colocated generation (the default)
    logged             data.offline_path: logged responses and rewards, no generation
    dynamic_sampling   algorithm.filter_groups.enable: DAPO, generate until the groups inform
    pool               trainer.rollout_pool=separate: a separate rollout pool (replaces the above;
                       validation refuses the combinations it cannot serve), streaming groups
                       with data.gen_batch_size > train_batch_size or algorithm.filter_groups
    replay             algorithm.replay.enable: wraps the source picked (PF-PPO, replayed groups)

Tests: tests/test_experience_parts.py, tests/test_trainer_paths.py, tests/test_streaming.py
"""
from engine.experience.dynamic_sampling import DynamicSampling
from engine.experience.logged import Logged
from engine.experience.online import Online
from engine.experience.pool import Pool
from engine.experience.replay import Replay
from engine.experience.streaming import Streaming

SOURCES = {"online": Online, "logged": Logged, "dynamic_sampling": DynamicSampling, "pool": Pool}
WRAPPERS = {"replay": Replay}


def source_names(cfg):
    """(the source's name, [wrapper names]) the config asks for."""
    if cfg.trainer.rollout_pool == "separate":
        name = "pool"
    elif cfg.data.offline_path is not None:  # logged responses: no generation
        name = "logged"
    elif cfg.algorithm.filter_groups.enable:  # DAPO: generate until the groups are informative
        name = "dynamic_sampling"
    else:
        name = "online"
    return name, ["replay"] if cfg.algorithm.replay.enable else []


def streams(cfg):
    """Whether the separate pool streams groups (engine/experience/streaming.py): over-sampling
    or DAPO's filter; else whole batches per step (engine/experience/pool.py)."""
    d = cfg.data
    return cfg.algorithm.filter_groups.enable or (d.gen_batch_size or d.train_batch_size) > d.train_batch_size


def build_experience(cfg, pool_client=None):
    """The source for `cfg`; `pool_client` (engine.rollout.pool.PoolClient) for a separate pool."""
    name, wrappers = source_names(cfg)
    if name == "pool":
        source = (Streaming if streams(cfg) else Pool)(cfg, pool_client, cfg.trainer.off_policy_steps)
    else:
        source = SOURCES[name](cfg)
    for w in wrappers:
        source = WRAPPERS[w](cfg, source)
    return source
