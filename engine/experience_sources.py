"""The experience source a config asks for (engine/experience.py defines the seam; the sources
beyond the online one live in their own modules, which build on it)."""
from engine.dynamic_sampling import DynamicSampling
from engine.experience import Online
from engine.experience_offline import Logged
from engine.replay import Replay


def build_experience(cfg):
    if cfg.data.offline_path is not None:  # logged responses: no generation
        source = Logged(cfg)
    elif cfg.algorithm.filter_groups.enable:  # DAPO: generate until the groups are informative
        source = DynamicSampling(cfg)
    else:
        source = Online(cfg)
    if cfg.algorithm.replay.enable:  # wraps any of them
        source = Replay(cfg, source)
    return source
