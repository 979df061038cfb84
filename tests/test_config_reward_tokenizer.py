"""The reward model (and a critic with its own model) reads the policy's token ids as they are
(engine/workers/reward_model.py: no decode, no re-tokenisation), so prepare() checks, before
any process group or model exists, that its vocabulary maps every policy token to the same id
and that its embedding has a row for each; otherwise one ConfigError naming the key and the fix.
The reference for "the same ids" is each tokenizer's own encoding of the same text."""
import os

import pytest
import torch
import transformers

from engine.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "reward_model.enable=true",
         "reward_model.micro_batch_size_per_gpu=8"]


def _rm(path, vocab_size=20):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=64,
                                   tie_word_embeddings=False, num_labels=1, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(path)
    return path


def _swapped_tokenizer(path):
    """The built-in tokenizer with the ids of '1' and '2' exchanged: same size, other ids."""
    from tokenizers import Tokenizer
    from engine.tasks import build_tokenizer
    tok = build_tokenizer()
    spec = tok.backend_tokenizer.to_str()
    a, b = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    spec = spec.replace(f'"1":{a}', '"1":X').replace(f'"2":{b}', f'"2":{a}').replace('"1":X', f'"1":{b}')
    other = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec),
                                                 bos_token=tok.bos_token, eos_token=tok.eos_token,
                                                 pad_token=tok.pad_token, unk_token=tok.unk_token)
    other.save_pretrained(path)
    return tok, other


def _prepare(*overrides):
    from engine.train import prepare
    return prepare(load_config(DEMO, SMALL + list(overrides)), 2)


def test_same_tokenizer_passes(tmp_path):
    from engine.tasks import save_tokenizer
    rm = _rm(str(tmp_path / "rm"))
    save_tokenizer(rm)
    prepared = _prepare(f"reward_model.model.path={rm}")
    assert prepared.reward_model_config.vocab_size == 20


def test_other_token_ids_are_refused(tmp_path):
    rm = _rm(str(tmp_path / "rm"))
    policy, other = _swapped_tokenizer(rm)
    assert policy.encode("12") != other.encode("12")  # the two really disagree on the same text
    with pytest.raises(ConfigError) as info:
        _prepare(f"reward_model.model.path={rm}")
    msg = str(info.value)
    assert f"reward_model.model.path={rm!r}" in msg and "'1'" in msg and "same tokenizer" in msg
    assert "\n" not in msg


def test_tokenizer_path_is_the_one_checked(tmp_path):
    """reward_model.model.tokenizer_path acts: it is the tokenizer compared, not the model dir's."""
    from engine.tasks import save_tokenizer
    rm = _rm(str(tmp_path / "rm"))
    save_tokenizer(rm)
    _swapped_tokenizer(str(tmp_path / "tok"))
    with pytest.raises(ConfigError, match=r"reward_model\.model\.tokenizer_path=.*tok'"):
        _prepare(f"reward_model.model.path={rm}", f"reward_model.model.tokenizer_path={tmp_path / 'tok'}")
    _prepare(f"reward_model.model.path={rm}", f"reward_model.model.tokenizer_path={rm}")


def test_smaller_vocabulary_and_missing_tokenizer_are_refused(tmp_path):
    from engine.tasks import save_tokenizer
    small = _rm(str(tmp_path / "small"), vocab_size=12)
    save_tokenizer(small)
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*small'.*12 .*20 tokens"):
        _prepare(f"reward_model.model.path={small}")
    bare = _rm(str(tmp_path / "bare"))
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*bare'.*no tokenizer.*tokenizer_path"):
        _prepare(f"reward_model.model.path={bare}")


def test_critic_with_its_own_model_is_checked_too(tmp_path):
    rm = _rm(str(tmp_path / "critic"))
    _swapped_tokenizer(rm)
    with pytest.raises(ConfigError, match=r"critic\.model\.path=.*critic'.*'1'"):
        _prepare("reward_model.enable=false", "algorithm.adv_estimator=gae", f"critic.model.path={rm}")
