"""The reward model on Megatron scores like transformers' LlamaForSequenceClassification
(its `score` head read from the same checkpoint), at TP=2."""
import dataclasses

import torch
import transformers

from tests.multirank import run_on_ranks
from tests.test_ppo_update import make_batch
from tests.tiny_models import tiny_config


def _scores(hf_dir, batch, layout):
    from engine.config import ModelConfig, RewardModelConfig, MegatronConfig
    from engine.models.hf_io import load_hf_weights
    from engine.workers.reward_model import RewardModelWorker
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(**layout), seed=1)
    hf = transformers.AutoConfig.from_pretrained(hf_dir)
    meg = dataclasses.replace(MegatronConfig(params_dtype="float32"),
                              tensor_model_parallel_size=layout.get("tp", 1))
    cfg = RewardModelConfig(enable=True, model=ModelConfig(path=hf_dir, use_remove_padding=True),
                            micro_batch_size_per_gpu=3, megatron=meg)
    worker = RewardModelWorker(hf, cfg)
    load_hf_weights(worker.chunks, hf_dir, hf_config=hf)
    return worker.compute_scores(batch)


def test_reward_model_matches_transformers_sequence_classification(tmp_path):
    cfg = tiny_config("llama", pad_token_id=0)
    cfg.num_labels = 1
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    batch = make_batch(cfg.vocab_size)
    scores = run_on_ranks(_scores, 2, str(tmp_path), batch, dict(tp=2))
    expected = []
    with torch.no_grad():
        for i in range(len(batch)):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]  # no pad inside
            expected.append(model(input_ids=ids[None]).logits[0, 0])
    expected = torch.stack(expected)
    for s in scores:  # every rank holds the scores; fp32, TP-split reductions
        torch.testing.assert_close(s, expected, atol=1e-5, rtol=1e-5)
