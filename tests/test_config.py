import dataclasses
import os

import pytest
import yaml

from engine.config import (ConfigError, TridentConfig, all_keys, apply_override, derive, from_dict,
                           load_config, to_dict, to_yaml, total_training_steps, validate_layout)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
MEG = "actor_rollout_ref.actor.megatron"


# The batch sizes these tests reason about, pinned so tuning the demo recipe does not move them.
PINNED = ["data.train_batch_size=16", "data.max_response_length=8", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]


def demo(*overrides):
    return load_config(DEMO, PINNED + list(overrides))


def error_of(fn, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def assert_mentions(message, *parts):
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ---------------------------------------------------------------- loading and round trip

def test_demo_recipe_matches_its_file():
    cfg = demo()
    with open(DEMO) as f:
        raw = yaml.safe_load(f)
    assert cfg.data.builtin_task == raw["data"]["builtin_task"] == "arith"
    assert cfg.actor_rollout_ref.model.config == raw["actor_rollout_ref"]["model"]["config"]
    assert cfg.actor_rollout_ref.rollout.name == "cpu"
    assert cfg.trainer.device == "cpu" and cfg.trainer.n_gpus_per_node == 2
    assert cfg.algorithm.adv_estimator == "grpo"
    # Keys absent from the file keep the schema defaults.
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == TridentConfig().actor_rollout_ref.actor.clip_ratio_c


def test_yaml_round_trip_is_exact(tmp_path):
    cfg = demo("trainer.experiment_name='1e-3'",  # a string that looks like a float must stay a string
               "actor_rollout_ref.actor.optim.lr=3.3e-7",
               "actor_rollout_ref.rollout.stop_token_ids=[2, 7]",
               "actor_rollout_ref.model.override_config={attention_dropout: 0.0}",
               "critic.optim.betas=[0.8, 0.95]")
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(str(path), [])
    assert again == cfg
    assert again.trainer.experiment_name == "1e-3"
    assert from_dict(to_dict(cfg)) == cfg
    assert to_yaml(again) == to_yaml(cfg)


def test_overrides_of_each_type():
    cfg = demo("actor_rollout_ref.actor.optim.lr=1e-3",           # float without a dot (YAML 1.2 style)
               "actor_rollout_ref.actor.kl_loss_coef=2",           # int accepted for float
               "actor_rollout_ref.actor.ppo_epochs=3",             # int
               "actor_rollout_ref.actor.use_kl_loss=false",        # bool
               "trainer.logger=[console,tensorboard]",             # list
               "trainer.resume_mode=disable",                      # enum
               "actor_rollout_ref.rollout.prompt_length=null",     # null
               "actor_rollout_ref.model.config.hidden_size=128",   # sub-key of a free-form dict
               "+trainer.project_name=p")                          # Hydra-style '+' is tolerated
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr == 1e-3 and type(actor.optim.lr) is float
    assert actor.kl_loss_coef == 2.0 and type(actor.kl_loss_coef) is float
    assert actor.ppo_epochs == 3 and actor.use_kl_loss is False
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.resume_mode == "disable" and cfg.trainer.project_name == "p"
    assert cfg.actor_rollout_ref.rollout.prompt_length is None
    model_config = cfg.actor_rollout_ref.model.config
    assert model_config["hidden_size"] == 128 and model_config["num_hidden_layers"] == 2  # merged, not replaced


def test_later_override_wins_and_lone_string_becomes_list():
    cfg = load_config(None, ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert cfg.data.train_files == ["/d/train.parquet"]
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.3


def test_every_schema_leaf_is_settable_by_its_dotted_name():
    defaults = to_dict(TridentConfig())
    cfg = TridentConfig()
    for key in all_keys():
        node = defaults
        for part in key.split("."):
            node = node[part]  # KeyError would mean all_keys() and the dataclasses disagree
        if not isinstance(node, dict) or key.endswith(("model.config", "override_config")):
            text = yaml.safe_dump(node, default_flow_style=True).removesuffix("...\n").strip()
            apply_override(cfg, f"{key}={text}")
    assert cfg == TridentConfig()  # every default survives being written back through its own key


def test_empty_yaml_section_means_defaults(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  builtin_task: arith\ncritic:\nactor_rollout_ref:\n  model:\n    path: /m\n"
                    "  actor:\n    ppo_micro_batch_size_per_gpu: 2\n")
    assert load_config(str(path)).critic == TridentConfig().critic


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("override, parts", [
    ("actor_rollout_ref.actor.kl_los_coef=0.1",
     ["'actor_rollout_ref.actor.kl_los_coef'", "did you mean 'actor_rollout_ref.actor.kl_loss_coef'"]),
    ("actor_rollout_ref.kl_loss_coef=0.1",  # right name, wrong section
     ["'actor_rollout_ref.kl_loss_coef'", "'actor_rollout_ref.actor.kl_loss_coef'"]),
    ("tranier.logger=[console]", ["'tranier'", "did you mean 'trainer'"]),
    ("actor_rollout_ref.actor.grad_clip=1.0", ["actor_rollout_ref.actor.optim.clip_grad"]),
    ("data.zzz=1", ["'data.zzz'", "no key of that name in 'data'", "DataConfig in engine/config/schema.py"]),
])
def test_unknown_override_key_names_it_and_suggests(override, parts):
    assert_mentions(error_of(demo, override), *parts)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  builtin_task: arith\n  max_promt_length: 8\n")
    assert_mentions(error_of(load_config, str(path), []),
                    "'data.max_promt_length'", "did you mean 'data.max_prompt_length'")


@pytest.mark.parametrize("override, parts", [
    ("actor_rollout_ref.actor.ppo_epochs=two", ["actor_rollout_ref.actor.ppo_epochs", "'two'", "expected int"]),
    ("actor_rollout_ref.actor.ppo_epochs=2.5", ["ppo_epochs", "2.5", "expected int"]),
    ("actor_rollout_ref.actor.ppo_epochs=true", ["ppo_epochs", "True", "expected int"]),
    ("actor_rollout_ref.actor.use_kl_loss=1", ["use_kl_loss", "1", "expected bool"]),
    ("actor_rollout_ref.actor.clip_ratio=high", ["clip_ratio", "'high'", "expected float"]),
    ("actor_rollout_ref.actor.clip_ratio=null", ["clip_ratio", "null", "expected float"]),
    ("trainer.experiment_name=7", ["experiment_name", "7", "expected str", "quote"]),
    ("trainer.logger=[console, 3]", ["trainer.logger[1]", "3"]),
    ("actor_rollout_ref.rollout.stop_token_ids=5", ["stop_token_ids", "5", "list of int"]),
    ("algorithm.kl_ctrl=0.1", ["algorithm.kl_ctrl", "0.1", "mapping"]),
    ("actor_rollout_ref.actor.optim.lr.value=1", ["actor_rollout_ref.actor.optim.lr", "not a section"]),
    ("actor_rollout_ref.actor.optim.lr", ["must look like", "="]),
])
def test_wrong_type_names_key_value_and_expected_type(override, parts):
    assert_mentions(error_of(demo, override), *parts)


@pytest.mark.parametrize("override, parts", [
    ("algorithm.adv_estimator=ppo", ["algorithm.adv_estimator='ppo'", "'gae'", "'grpo'", "'rloo'"]),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", ["loss_agg_mode='mean'", "'token-mean'"]),
    ("actor_rollout_ref.actor.kl_loss_type=k9", ["kl_loss_type='k9'", "'low_var_kl+'"]),
    ("data.truncation=middle", ["data.truncation='middle'", "'filter'"]),
])
def test_unknown_enum_value_lists_allowed_ones(override, parts):
    assert_mentions(error_of(demo, override), *parts)


@pytest.mark.parametrize("overrides, parts", [
    (["actor_rollout_ref.actor.optim.lr=-1e-4"], ["actor_rollout_ref.actor.optim.lr=-0.0001", ">= 0"]),
    (["actor_rollout_ref.actor.clip_ratio=0"], ["actor_rollout_ref.actor.clip_ratio=0.0", "> 0"]),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], ["clip_ratio_c=0.5", "> 1"]),
    (["algorithm.gamma=1.5"], ["algorithm.gamma=1.5", "<= 1"]),
    (["algorithm.lam=-0.1"], ["algorithm.lam=-0.1", ">= 0"]),
    (["actor_rollout_ref.rollout.top_p=0"], ["top_p=0.0", "> 0"]),
    (["actor_rollout_ref.rollout.top_k=0"], ["top_k=0", ">= 1", "-1"]),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], ["betas=[0.9]", "[0.9, 0.999]"]),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=5"],
     ["ppo_mini_batch_size=5", "data.train_batch_size=16", "1, 2, 4, 8, 16"]),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
     ["ppo_micro_batch_size_per_gpu=None", "use_dynamic_bsz=true"]),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"],
     ["ppo_max_token_len_per_gpu=10", "at least 24"]),
    (["actor_rollout_ref.rollout.n=1"], ["actor_rollout_ref.rollout.n=1", "'grpo'", ">= 2"]),
    (["algorithm.adv_estimator=gae", "critic.enable=false"], ["critic.enable=False", "'gae'", "critic.enable=true"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_from_path=None", "resume_path"]),
    (["trainer.save_freq=0"], ["trainer.save_freq=0", ">= 1", "-1"]),
    (["data.builtin_task=null"], ["data.train_files=[]", "builtin_task"]),
    (["data.train_files=[a.parquet]"], ["data.builtin_task='arith'", "train_files"]),
    (["actor_rollout_ref.model.config=null"], ["actor_rollout_ref.model.path=None", "model.config"]),
    (["actor_rollout_ref.model.path=/m"], ["actor_rollout_ref.model.config", "override_config"]),
    (["reward_model.enable=true"], ["reward_model.model.path=None", "enable=false"]),
    (["actor_rollout_ref.rollout.name=sglang"], ["rollout.name='sglang'", "rollout.name=cpu"]),
    ([f"{MEG}.recompute_granularity=full"], [f"{MEG}.recompute_method=None", "'uniform'"]),
    ([f"{MEG}.tensor_model_parallel_size=0"], [f"{MEG}.tensor_model_parallel_size=0", ">= 1"]),
    (["actor_rollout_ref.hybrid_engine=false"], ["hybrid_engine=False", "true"]),
])
def test_impossible_values_name_key_value_and_fix(overrides, parts):
    assert_mentions(error_of(demo, *overrides), *parts)


def test_demo_recipe_passes_layout_and_derivation_on_its_declared_ranks():
    # The cases above are single overrides of this valid recipe.
    d = derive(demo(), dataset_len=64)
    assert d.layout.world_size == 2


# ---------------------------------------------------------------- layout

def layout_cfg(world, *overrides):
    return demo(f"trainer.n_gpus_per_node={world}", *overrides)


def test_valid_tp2_pp2_on_four_ranks():
    cfg = layout_cfg(4, f"{MEG}.tensor_model_parallel_size=2", f"{MEG}.pipeline_model_parallel_size=2",
                     f"{MEG}.virtual_pipeline_model_parallel_size=2")
    validate_layout(cfg, 4, num_layers=4)
    d = derive(cfg, 4, cuda_available=False)
    assert (d.layout.tp, d.layout.pp, d.layout.vpp, d.layout.dp) == (2, 2, 2, 4 // (2 * 2))
    assert d.layout.etp == 2  # null expert TP means "same as TP"
    assert d.config.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2  # inherited


def test_valid_ep2_on_two_ranks():
    cfg = layout_cfg(2, f"{MEG}.expert_model_parallel_size=2")
    validate_layout(cfg, 2, num_experts=4)
    d = derive(cfg, 2)
    assert (d.layout.ep, d.layout.etp, d.layout.expert_dp, d.layout.dp) == (2, 1, 2 // (1 * 2 * 1), 2)


def test_valid_moe_tp2_ep2_etp1_with_sequence_parallel_on_four_ranks():
    cfg = layout_cfg(4, f"{MEG}.tensor_model_parallel_size=2", f"{MEG}.expert_model_parallel_size=2",
                     f"{MEG}.expert_tensor_parallel_size=1", f"{MEG}.sequence_parallel=true")
    validate_layout(cfg, 4, num_layers=2, num_experts=8)
    d = derive(cfg, 4)
    assert (d.layout.dp, d.layout.expert_dp) == (4 // 2, 4 // (2 * 1))


@pytest.mark.parametrize("world, overrides, kwargs, parts", [
    (4, [f"{MEG}.tensor_model_parallel_size=3"], {},
     [f"{MEG}.tensor_model_parallel_size=3", "world size 4", "use 1, 2 or 4"]),
    (4, [f"{MEG}.tensor_model_parallel_size=2", f"{MEG}.pipeline_model_parallel_size=4"], {},
     [f"{MEG}.pipeline_model_parallel_size=4", "world size 4", "tensor_model_parallel_size=2", "use 1 or 2"]),
    (4, [f"{MEG}.context_parallel_size=8"], {}, ["context_parallel_size=8", "world size 4"]),
    (4, [f"{MEG}.pipeline_model_parallel_size=2", f"{MEG}.expert_model_parallel_size=4"], {},
     [f"{MEG}.expert_model_parallel_size=4", "world size 4", "pipeline_model_parallel_size 2", "use"]),
    (4, [f"{MEG}.tensor_model_parallel_size=2", f"{MEG}.expert_model_parallel_size=4"], {},
     ["expert_model_parallel_size=4", "4 x 2", "world size 4"]),  # ETP defaults to TP=2: 4 x 2 > 4
    (2, [f"{MEG}.virtual_pipeline_model_parallel_size=2"], {},
     ["virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size > 1"]),
    (4, [f"{MEG}.pipeline_model_parallel_size=2", f"{MEG}.virtual_pipeline_model_parallel_size=2"],
     {"num_layers": 6}, ["virtual_pipeline_model_parallel_size=2", "6 layers"]),
    (4, [f"{MEG}.pipeline_model_parallel_size=4"], {"num_layers": 6}, ["pipeline_model_parallel_size=4", "6 layers"]),
    (2, [f"{MEG}.sequence_parallel=true"], {}, [f"{MEG}.sequence_parallel=True", "tensor_model_parallel_size > 1"]),
    (2, [f"{MEG}.tensor_model_parallel_size=2"], {"num_experts": 4},
     [f"{MEG}.sequence_parallel=False", "MoE", "sequence_parallel=true"]),
    (2, [f"{MEG}.expert_model_parallel_size=2"], {"num_experts": 3}, ["expert_model_parallel_size=2", "3 experts"]),
    (2, [f"{MEG}.expert_model_parallel_size=2"], {"num_experts": 0}, ["expert_model_parallel_size=2", "dense"]),
    (2, ["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"], {},
     ["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", f"{MEG}.tensor_model_parallel_size=1", "null"]),
    (4, ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], {},
     ["rollout.tensor_model_parallel_size=3", "world size 4"]),
])
def test_bad_layouts_name_key_value_world_and_fix(world, overrides, kwargs, parts):
    cfg = layout_cfg(world, *overrides)
    assert_mentions(error_of(validate_layout, cfg, world, **kwargs), *parts)


def test_launched_world_size_must_match_trainer():
    assert_mentions(error_of(derive, demo(), 4), "trainer.n_gpus_per_node=2", "4 ranks", "launch 2")


# ---------------------------------------------------------------- derived values

def test_batch_arithmetic_follows_verl_semantics():
    cfg = layout_cfg(4, "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                     "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                     "actor_rollout_ref.actor.ppo_epochs=2", f"{MEG}.tensor_model_parallel_size=2")
    d = derive(cfg, 4)
    dp = 4 // 2
    mini_sequences = 8 * 3
    assert d.layout.dp == dp
    assert d.rollout_batch_size == 32 * 3 and d.rollout_batch_size_per_rank == 32 * 3 // dp
    assert d.actor.mini_batch_size == mini_sequences
    assert d.actor.mini_batch_size_per_rank == mini_sequences // dp
    assert d.actor.grad_accum_steps == mini_sequences // dp // 2
    assert d.actor.mini_batches_per_epoch == 32 // 8 and d.actor.ppo_epochs == 2
    assert d.critic is None and not d.use_critic  # grpo: no critic


def test_micro_must_divide_per_rank_mini_batch():
    cfg = demo("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5")  # per rank: 8 x 4 / 2 = 16
    assert_mentions(error_of(derive, cfg, 2), "ppo_micro_batch_size_per_gpu=5", "16 sequences",
                    "use 1, 2, 4, 8 or 16")


def test_dynamic_bsz_has_no_fixed_micro_batch():
    cfg = demo("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null")
    d = derive(cfg, 2)
    assert d.actor.micro_batch_size_per_rank is None and d.actor.grad_accum_steps is None
    assert d.config.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True
    assert d.config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == \
        cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu


def test_total_steps_and_warmup_from_dataset_length():
    cfg = demo("trainer.total_training_steps=null", "trainer.total_epochs=3",
               "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    expected = (100 // 16) * 3  # full batches only
    assert total_training_steps(cfg, 100) == expected
    d = derive(cfg, 2, dataset_len=100)
    optim = d.config.actor_rollout_ref.actor.optim
    assert d.config.trainer.total_training_steps == optim.total_training_steps == expected
    assert optim.lr_warmup_steps == int(0.1 * expected)
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps is None  # derive() copies, never mutates
    assert_mentions(error_of(total_training_steps, cfg, 10), "data.train_batch_size=16", "only 10 prompts")
    # An explicit trainer value wins over the dataset length.
    assert total_training_steps(demo("trainer.total_training_steps=7"), 10_000) == 7


def test_null_keys_resolve_to_their_sources():
    cfg = demo("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.clip_ratio_high=0.28",
               "trainer.default_local_dir=null", "trainer.device=auto", "actor_rollout_ref.rollout.name=auto")
    d = derive(cfg, 2, cuda_available=False)
    c = d.config
    assert c.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length
    assert c.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length
    assert c.actor_rollout_ref.actor.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio
    assert c.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert c.critic.enable and d.use_critic and d.critic == d.actor  # critic inherits the actor's batching
    assert c.critic.model.config == cfg.actor_rollout_ref.model.config
    assert c.trainer.device == "cpu" and c.actor_rollout_ref.rollout.name == "cpu"
    assert c.trainer.default_local_dir == f"checkpoints/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    assert d.use_reference == cfg.actor_rollout_ref.actor.use_kl_loss
    assert derive(cfg, 2, cuda_available=True).config.actor_rollout_ref.rollout.name == "sglang"


def test_filter_overlong_prompts_and_truncation_agree_after_derive():
    d = derive(demo("data.filter_overlong_prompts=true"), 2)
    assert d.config.data.truncation == "filter" and d.config.data.filter_overlong_prompts
    d = derive(demo("data.truncation=filter"), 2)
    assert d.config.data.filter_overlong_prompts


def test_derived_config_round_trips_and_rederives_identically(tmp_path):
    d = derive(demo("trainer.total_training_steps=null"), 2, dataset_len=64)
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(d.config))
    again = derive(load_config(str(path)), 2, dataset_len=64)
    assert dataclasses.asdict(again.config) == dataclasses.asdict(d.config) and again.actor == d.actor


def test_reference_and_critic_take_the_actors_param_dtype():
    from engine.config import derive
    d = derive(demo("actor_rollout_ref.actor.megatron.params_dtype=float32",
                    "algorithm.adv_estimator=gae"), 2)
    assert d.config.actor_rollout_ref.ref.megatron.params_dtype == "float32"
    assert d.config.critic.megatron.params_dtype == "float32"
    d = derive(demo("actor_rollout_ref.actor.megatron.params_dtype=float32",
                    "actor_rollout_ref.ref.megatron.params_dtype=bfloat16"), 2)
    assert d.config.actor_rollout_ref.ref.megatron.params_dtype == "bfloat16"
    assert_mentions(error_of(demo, "actor_rollout_ref.actor.megatron.params_dtype=null"),
                    "actor_rollout_ref.actor.megatron.params_dtype", "float32")


def _whole_prompt_case(world, tp, batch, n, rollout_tp):
    return layout_cfg(world, f"data.train_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}",
                      f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
                      "actor_rollout_ref.actor.use_dynamic_bsz=true",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                      f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}",
                      f"{MEG}.tensor_model_parallel_size={tp}", "algorithm.adv_estimator=rloo"
                      if n > 1 else "algorithm.adv_estimator=reinforce_plus_plus")


def test_step_batch_splits_over_dp_in_whole_prompts():
    """Generation hands each DP replica whole prompts (all n responses of a prompt train on one
    replica): derive() accepts exactly the batches the rollout's route_plan can split, over
    every rollout-group count, instead of the first generation raising after the models are
    built. Reference: engine/rollout/topology.route_plan itself."""
    import itertools

    from engine.rollout.topology import route_plan
    seen = {True: 0, False: 0}
    for world, tp, batch, n, rollout_tp in itertools.product((2, 4), (1, 2), (2, 3, 4, 6), (1, 2, 3), (1, 2)):
        if tp > world or rollout_tp > world:
            continue
        cfg = _whole_prompt_case(world, tp, batch, n, rollout_tp)
        dp = world // tp
        try:
            route_plan(batch, world // rollout_tp, dp)
            splits = True
        except ValueError:
            splits = False
        seen[splits] += 1
        if splits:
            d = derive(cfg, world)
            assert d.rollout_batch_size_per_rank == batch * n // dp
        else:
            msg = error_of(derive, cfg, world)
            assert_mentions(msg, f"data.train_batch_size={batch}", f"rollout.n {n}", f"{dp} data-parallel")
    assert seen[True] and seen[False]
    # the case the old check let through: 3 prompts x 2 = 6 sequences over DP 2, 3 prompts do not
    msg = error_of(derive, _whole_prompt_case(2, 1, 3, 2, 1), 2)
    assert_mentions(msg, "data.train_batch_size=3", "whole prompts", "multiple of 2")
    assert "\n" not in msg
