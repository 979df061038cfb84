"""A tokenizer without a pad token (many base models ship none): the run decides the pad id once
(engine.data.pad_token_id: the eos token) and every part that pads uses it; the step must not
reach torch.full(..., None)."""
import os

import pytest

from tests.multirank import run_on_ranks

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu_demo.yaml")


def _step_without_pad(tmp):
    import engine.tasks
    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    made = engine.tasks.build_tokenizer

    def without_pad():
        tok = made()
        tok.pad_token = None
        return tok
    engine.tasks.build_tokenizer = without_pad
    try:
        cfg = load_config(DEMO, [
            "trainer.n_gpus_per_node=1", "trainer.logger=[]", "trainer.resume_mode=disable",
            "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
            f"trainer.log_dir={tmp}/logs", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"])
        set_seed(cfg.trainer.seed)
        derived, c = build(cfg, 1)
    finally:
        engine.tasks.build_tokenizer = made

    class Recording(Trainer):
        def compute_advantages(self, batch):
            self.seen = batch
            return super().compute_advantages(batch)

    t = Recording(derived, c)
    assert c.tokenizer.pad_token_id is None
    t.train_step(t.loader.next_batch())
    b = t.seen
    width = b["responses"].shape[1]
    prompt_pad = b["input_ids"][:, :-width][b["attention_mask"][:, :-width] == 0]
    response_pad = b["responses"][b["response_mask"] == 0]
    engines = [g for g in (getattr(t.rollout, "engine", None),) if g is not None]
    out = dict(eos=c.tokenizer.eos_token_id, trainer=t.ctx.pad_id,
               workers=[w.pad_token_id for w in (t.actor, t.ref) if w is not None],
               engines=[e.pad_token_id for e in engines if hasattr(e, "pad_token_id")],
               prompt_pad=sorted(set(prompt_pad.tolist())), response_pad=sorted(set(response_pad.tolist())))
    t.colocated.to_training()
    t.rollout.shutdown()
    return out


def test_a_tokenizer_without_a_pad_token_pads_with_eos_everywhere(tmp_path):
    out = run_on_ranks(_step_without_pad, 1, str(tmp_path))[0]
    eos = out["eos"]
    assert eos is not None
    assert out["trainer"] == eos and out["workers"] == [eos, eos]
    assert out["engines"] == [eos]  # the CPU engine pads its prompts with it too
    assert out["prompt_pad"] in ([], [eos]) and out["response_pad"] in ([], [eos])
    assert out["prompt_pad"] or out["response_pad"]  # the batch has padding to look at


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused():
    from engine.data import pad_token_id

    class Tok:
        pad_token_id = eos_token_id = None
        name_or_path = "some/model"
    with pytest.raises(ValueError, match="some/model.*neither a pad token nor an eos token"):
        pad_token_id(Tok())

    class Pad:
        pad_token_id, eos_token_id = 3, 7
    assert pad_token_id(Pad()) == 3
