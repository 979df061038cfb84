"""What a run loads before it builds anything: the model's HF config (checked against what
Trident supports), its Megatron spec, the tokenizer, the prompt datasets; and the copy of one
model's weights into another (the reference from the actor).

Tests: tests/test_bad_inputs.py, tests/test_sglang_double.py, tests/test_e2e.py
"""
import os

from engine.algorithms.correction import plan_of
from engine.config import ConfigError


def load_hf_config(model_cfg, vocab_size=None, key="actor_rollout_ref.model"):
    """The HF config of the model: from `model.path`, or built from the inline `model.config`.
    `key`: the recipe section of `model_cfg`, named in errors."""
    import transformers
    if model_cfg.path:
        if not os.path.isfile(os.path.join(model_cfg.path, "config.json")):
            what = "does not exist" if not os.path.exists(model_cfg.path) else "has no config.json"
            raise ConfigError(f"{key}.path={model_cfg.path!r} {what}; set it to a HuggingFace model "
                              "directory (config.json + *.safetensors)")
        try:
            cfg = transformers.AutoConfig.from_pretrained(model_cfg.path,
                                                          trust_remote_code=model_cfg.trust_remote_code)
        except _hf_config_errors() as e:  # unreadable JSON, unknown model_type, bad values
            raise ConfigError(f"{key}.path={model_cfg.path!r}: its config.json is not usable: "
                              f"{_hf_reason(e)}; fix config.json or pass another model directory") from None
    else:
        inline = dict(model_cfg.config)
        model_type = inline.pop("model_type", None)
        if model_type is None:
            raise ConfigError(f"{key}.config needs a model_type (e.g. llama)")
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **inline)
        except _hf_config_errors() as e:  # unknown model_type, or values transformers refuses
            raise ConfigError(f"{key}.config (model_type={model_type!r}) is not usable: "
                              f"{_hf_reason(e)}; fix {key}.config") from None
    for name, value in (model_cfg.override_config or {}).items():
        setattr(cfg, name, value)
    if not getattr(cfg, "architectures", None):
        from engine.models.arch import architecture_of
        cfg.architectures = [architecture_of(cfg)]
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ConfigError(f"{key}.config.vocab_size={cfg.vocab_size}: the model's vocabulary is smaller than "
                          f"the tokenizer's {vocab_size} tokens; set it to >= {vocab_size}")
    return cfg


def _hf_config_errors():
    """What transformers raises for a config it refuses (not for its own bugs)."""
    from huggingface_hub.errors import StrictDataclassError
    return (OSError, ValueError, TypeError, StrictDataclassError)


def _hf_reason(error):
    """transformers' reason, short: the validator's own message, without the list of every
    model type it knows."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    if "Should contain one of" in text:
        from engine.models.arch import MODEL_TYPES
        text = text.split(". Should contain one of")[0] + f" (Trident supports {', '.join(MODEL_TYPES)})"
    return text.rstrip(".")


def model_spec(hf_config, model_cfg, key="actor_rollout_ref.model"):
    """engine.models.arch.arch_spec, its errors saying which recipe section the config is from."""
    from engine.errors import ModelError
    from engine.models.arch import arch_spec
    try:
        return arch_spec(hf_config)
    except ModelError as e:
        where = f"{key}.path={model_cfg.path!r} (config.json)" if model_cfg.path else f"{key}.config"
        raise ModelError(f"{where}: {e}") from None


def load_tokenizer(cfg):
    from transformers import AutoTokenizer
    model = cfg.actor_rollout_ref.model
    path = model.tokenizer_path or model.path
    if path:
        key = "tokenizer_path" if model.tokenizer_path else "path"
        if not os.path.isdir(path):
            raise ConfigError(f"actor_rollout_ref.model.{key}={path!r} is not a directory; set it to "
                              "a HuggingFace tokenizer (or model) directory")
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"actor_rollout_ref.model.{key}={path!r}: no usable tokenizer there "
                              f"({str(e).splitlines()[0]}); point it at a directory with "
                              "tokenizer.json / tokenizer_config.json") from None
    if cfg.data.builtin_task:
        from engine.tasks import builtin_tokenizer
        return builtin_tokenizer(cfg.data.builtin_task)
    raise ConfigError("actor_rollout_ref.model.tokenizer_path=None: no tokenizer; set it or model.path")


def load_datasets(cfg, tokenizer):
    from engine.data import PromptDataset, truncation_of
    data = cfg.data
    kw = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length,
              truncation=truncation_of(data), prompt_key=data.prompt_key,
              apply_chat_template=data.chat_template)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.enable and mt.tools_in_prompt:  # the tools' schemas in the prompt, as verl renders it
        from engine.rollout.tool_actor import tools_of
        kw["tools"] = [t.schema for t in tools_of(mt).values()]
    if data.builtin_task:
        from engine.tasks import make_builtin_task
        train_rows, val_rows, _ = make_builtin_task(data.builtin_task, seed=data.seed,
                                                    difficulty=data.builtin_task_difficulty)
        return PromptDataset(train_rows, **kw), PromptDataset(val_rows, **kw)
    if data.offline_path is not None:  # logged responses: the prompts and what answered them
        from engine.data.logged import LoggedDataset
        train = LoggedDataset(data.offline_path, n=cfg.actor_rollout_ref.rollout.n,
                              response_length=cfg.actor_rollout_ref.rollout.response_length
                              or data.max_response_length,
                              need_log_probs=plan_of(cfg.algorithm.rollout_correction).active, **kw)
        val = PromptDataset(list(data.val_files), **kw) if data.val_files else None
        return train, val
    train = PromptDataset(data_of(cfg, "train", tokenizer), **kw)
    val = PromptDataset(data_of(cfg, "val", tokenizer), **kw) if data.val_files else None
    return train, val


def data_of(cfg, which, tokenizer):
    """What a dataset of `which` ('train' / 'val') files is built from: the parquet files, or the
    rows of a HF dataset or of the user's dataset class (engine/data/sources.py)."""
    import dataclasses

    from engine.data.sources import rows_or_files
    d = cfg.data
    return rows_or_files(list(getattr(d, f"{which}_files")), getattr(d, f"{which}_split"), f"data.{which}_files",
                         custom=(d.custom_cls.path, d.custom_cls.name), tokenizer=tokenizer,
                         config=dataclasses.asdict(d))


def copy_weights(src_chunks, dst_chunks):
    """Same layout, same model: the reference starts as the actor."""
    import torch

    from parallel import fsdp
    from parallel.shards import local_shards
    src = {s.global_name: p for p, s in local_shards(src_chunks)}
    with torch.no_grad(), fsdp.gathered(src_chunks):  # collective for a fully sharded source
        for p, s in local_shards(dst_chunks):
            if s.global_name in src and src[s.global_name].shape == p.shape:
                fsdp.write(p, fsdp.value(src[s.global_name]))
