"""Keys that act through the real trainer (CPU ranks): each test fails if its key is ignored."""
import os
import sys

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKES = os.path.join(ROOT, "tests", "fakes")
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]


def demo_trainer(overrides, tmp, world=2):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [f"trainer.n_gpus_per_node={world}", "trainer.logger=[]", "trainer.test_freq=-1",
                             f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs/{dist.get_rank()}",
                             *SMALL, *overrides])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, world)
    return Trainer(derived, components)


def _save_contents(tmp):
    import json

    t = demo_trainer(["trainer.resume_mode=disable", "trainer.save_freq=1",
                      "actor_rollout_ref.actor.checkpoint.save_contents=[model]"], tmp)
    t.train_step(t.loader.next_batch())
    t.step_count = 1
    t.save()
    step_dir = os.path.join(tmp, "ckpt", "global_step_1")
    meta = json.load(open(os.path.join(step_dir, "meta.json")))
    files = sorted(os.listdir(step_dir))
    resumed = demo_trainer(["trainer.resume_mode=auto"], tmp)
    resumed.resume()
    from engine.checkpoint.state import has_optimizer_state
    return dict(meta=meta, files=files, step=resumed.step_count, position=resumed.loader.state_dict(),
                fresh_optimizer=not has_optimizer_state(resumed.actor))


def test_save_contents_model_only(tmp_path):
    for res in run_on_ranks(_save_contents, 2, str(tmp_path)):
        assert res["meta"]["contents"] == ["model"]
        assert all(not w["optimizer"] and not w["scheduler"] for w in res["meta"]["workers"].values())
        assert "trainer_state.pt" not in res["files"]
        # resumed at the step, the data position derived from it (one batch per step)
        assert res["step"] == 1 and res["position"]["batches_done"] == 1
        assert res["fresh_optimizer"]  # no Adam moments were saved, none restored


def _critic_from_its_own_model(tmp):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from parallel.shards import iter_global
    path = os.path.join(tmp, "rm")
    if int(os.environ["RANK"]) == 0:
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=20, max_position_embeddings=64, num_labels=1,
                          pad_token_id=0, tie_word_embeddings=False)
        torch.manual_seed(3)
        LlamaForSequenceClassification(cfg).save_pretrained(path)
        from engine.tasks import save_tokenizer
        save_tokenizer(path)  # the policy's: a critic reads its token ids as they are
    torch.distributed.barrier()
    t = demo_trainer(["trainer.resume_mode=disable", "algorithm.adv_estimator=gae",
                      f"critic.model.path={path}", "critic.ppo_micro_batch_size_per_gpu=4"], tmp)
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "model.safetensors"))
    critic = dict(iter_global(t.critic.chunks, "param"))
    head = next(v for k, v in critic.items() if "output_layer" in k or "value" in k)
    emb = next(v for k, v in critic.items() if "embedding" in k)
    return dict(head=torch.equal(head.reshape(-1), saved["score.weight"].reshape(-1)),
                emb=torch.equal(emb, saved["model.embed_tokens.weight"]),
                hidden=t.critic.hf_config.hidden_size, actor_hidden=t.hf_config.hidden_size)


def test_critic_is_built_from_its_own_model(tmp_path):
    for res in run_on_ranks(_critic_from_its_own_model, 2, str(tmp_path)):
        assert res["hidden"] == 32 and res["actor_hidden"] == 64  # not the actor's model
        assert res["emb"] and res["head"]  # the reward model's trunk and its score head


def _validation_chunks(val_batch_size, tmp):
    sys.path.insert(0, FAKES)
    try:
        import sglang
        sglang.RECORDS.clear()
        t = demo_trainer(["trainer.resume_mode=disable", "actor_rollout_ref.rollout.name=sglang",
                          f"data.val_batch_size={val_batch_size}"], tmp)
        metrics = t.validate()
        sizes = [len(e["prompts"]) for e in sglang.RECORDS if e["kind"] == "generate"]
        return dict(metrics=metrics, sizes=sizes, n=len(t.val_data))
    finally:
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            sys.modules.pop(name)


def test_val_batch_size_chunks_validation(tmp_path):
    whole = run_on_ranks(_validation_chunks, 2, "null", str(tmp_path))
    chunked = run_on_ranks(_validation_chunks, 2, 16, str(tmp_path))
    n = whole[0]["n"]
    # two rollout groups (rollout TP 1 on 2 ranks): each leader generates half of each chunk
    assert [r["sizes"] for r in whole] == [[n // 2], [n // 2]]
    assert [r["sizes"] for r in chunked] == [[8] * (n // 16)] * 2
    assert whole[0]["metrics"] == chunked[0]["metrics"]  # greedy: the same scores either way
