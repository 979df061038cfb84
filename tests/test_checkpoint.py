"""engine.checkpoint: a resumed run continues exactly as if it had never stopped.

The real test of a resume: after one PPO step, save; then (a) the original worker and (b) a fresh
worker (different initial weights) loaded from the checkpoint both take the same second step,
and their weights must agree bit for bit. That holds only if the weights, Adam's moments and
step count, and the LR schedule (cosine: the second step's lr differs from the first's) were
all restored. Crash safety, retention, checksums and shape validation are checked directly.
"""
import dataclasses
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.test_ppo_update import B, R, make_batch, make_configs
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_actor(hf=None, weight_salt="", strategy="megatron", dtype="float32"):
    """An actor with a cosine LR schedule over 4 steps, weights generated from their names."""
    from engine.workers.actor import ActorWorker
    from parallel.shards import load_global, local_shards

    actor_cfg, _, model_cfg = make_configs()
    actor_cfg = dataclasses.replace(
        actor_cfg, optim=dataclasses.replace(actor_cfg.optim, lr_decay_style="cosine"), strategy=strategy,
        megatron=dataclasses.replace(actor_cfg.megatron, params_dtype=dtype))
    worker = ActorWorker(hf or tiny_config("llama"), actor_cfg, model_cfg, total_steps=4,
                         response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n + weight_salt, shapes[n]))
    return worker


def ppo_step(worker, seed):
    from megatron.core import parallel_state as ps
    batch = make_batch(worker.hf_config.vocab_size, seed=seed)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))
    worker.mini_batch_size_per_rank = len(mine)
    old = worker.compute_log_prob(mine, micro_batch_size=2)
    mine["old_log_probs"] = old + mine["noise"] * mine["response_mask"]
    mine["ref_log_prob"] = old - 0.5 * mine["noise"] * mine["response_mask"]
    return worker.update_policy(mine)


def actor_weights(worker):
    from parallel.shards import iter_global
    return {n: t.clone() for n, t in iter_global(worker.chunks, "param")}


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(3))


def _resume_run(layout_kwargs, root):
    from engine.algorithms.kl import AdaptiveKLController
    from engine.checkpoint import CheckpointManager
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(**layout_kwargs), seed=1)
    original = make_actor()
    ppo_step(original, seed=3)
    kl = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    kl.update(0.2, 8)
    trainer_state = dict(global_steps=1, data=dict(epoch=0, consumed=8), kl_ctrl=kl.state_dict())
    manager = CheckpointManager(root)
    path = manager.save(1, {"actor": original}, trainer_state)
    draws_after_save = _draws()
    at_save = actor_weights(original)
    lr_at_save = original.optimizer.param_groups[0]["lr"]
    ppo_step(original, seed=4)

    restored = make_actor(weight_salt="-other")
    differed = any(not torch.equal(t, at_save[n]) for n, t in actor_weights(restored).items())
    _draws()  # move every generator away from the saved states
    resumed_state = manager.load(manager.resolve("auto"), {"actor": restored})  # verified
    draws_after_load = _draws()
    loaded = actor_weights(restored)
    lr_loaded = restored.optimizer.param_groups[0]["lr"]
    ppo_step(restored, seed=4)
    return dict(path=path, latest=manager.latest(), differed=differed, at_save=at_save,
                loaded=loaded, lr=(lr_at_save, lr_loaded), draws=(draws_after_save, draws_after_load),
                continued=actor_weights(original), resumed=actor_weights(restored),
                trainer_state=(trainer_state, resumed_state))


LAYOUTS = [("dp2", {}), ("tp2", dict(tp=2)), ("pp2", dict(pp=2))]


@pytest.mark.parametrize("layout", [l for _, l in LAYOUTS], ids=[n for n, _ in LAYOUTS])
def test_resume_continues_bit_exactly(layout, tmp_path):
    results = run_on_ranks(_resume_run, 2, layout, str(tmp_path))
    assert results[0]["path"] == str(tmp_path / "global_step_1") == results[0]["latest"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    for res in results:
        assert res["differed"], "the fresh worker must start from other weights"
        assert res["loaded"].keys() == res["at_save"].keys()
        for name, tensor in res["at_save"].items():
            assert torch.equal(res["loaded"][name], tensor), name
        lr_saved, lr_loaded = res["lr"]
        assert lr_loaded == lr_saved
        saved_draws, loaded_draws = res["draws"]
        assert saved_draws[:2] == loaded_draws[:2]
        assert torch.equal(saved_draws[2], loaded_draws[2])
        assert res["trainer_state"][1] == res["trainer_state"][0]
        moved = 0
        for name, tensor in res["continued"].items():
            assert torch.equal(res["resumed"][name], tensor), f"after the next step: {name}"
            moved += int(not torch.equal(tensor, res["at_save"][name]))
        assert moved > len(res["continued"]) // 2, "the second step should move most weights"


def _reshard_run(root):
    from engine.checkpoint import CheckpointError, CheckpointManager
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(tp=2), seed=1)
    saved_from = make_actor()
    ppo_step(saved_from, seed=3)
    manager = CheckpointManager(root)
    manager.save(1, {"actor": saved_from}, {"global_steps": 1})
    saved = actor_weights(saved_from)

    init_mesh(Layout(), seed=1)  # TP=1: both ranks are data-parallel replicas
    at_tp1 = make_actor(weight_salt="-other")
    out = dict(errors={})
    try:
        manager.load(manager.latest(), {"actor": at_tp1})
    except CheckpointError as e:
        out["errors"]["optimizer"] = str(e)
    manager.load(manager.latest(), {"actor": at_tp1}, load_optimizer=False)
    out.update(saved=saved, loaded=actor_weights(at_tp1))
    for label, hf in (("smaller", tiny_config("llama", intermediate_size=48)),
                      ("fewer_layers", tiny_config("llama", num_hidden_layers=2)),
                      ("tied", tiny_config("llama", tie_word_embeddings=True))):
        try:
            manager.load(manager.latest(), {"actor": make_actor(hf)}, load_optimizer=False)
        except CheckpointError as e:
            out["errors"][label] = str(e)
    return out


def test_weights_load_at_another_layout_and_other_shapes_fail_clearly(tmp_path):
    """TP=2 -> TP=1: weights bit-identical; the optimizer (TP-specific format) and models of
    another shape or architecture are refused with errors naming the tensor."""
    results = run_on_ranks(_reshard_run, 2, str(tmp_path))
    for res in results:
        assert res["loaded"].keys() == res["saved"].keys()
        for name, tensor in res["saved"].items():
            assert torch.equal(res["loaded"][name], tensor), name
    errors = results[0]["errors"]
    assert set(errors) == {"optimizer", "smaller", "fewer_layers", "tied"}, errors
    assert "tp=2 there, 1 here" in errors["optimizer"] and "load_optimizer=False" in errors["optimizer"]
    assert "linear_fc1.weight" in errors["smaller"] and "different model size" in errors["smaller"]
    assert "(4, " in errors["fewer_layers"] and "(2, " in errors["fewer_layers"]
    assert "output_layer.weight" in errors["tied"]


def _save_and_fail(root):
    """Two ranks save step 1, then crash in the middle of saving step 2 (after the worker files
    are written); then load step 1 and save step 3."""
    from engine.checkpoint import manager as module
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    worker = make_actor()
    ppo_step(worker, seed=3)
    manager = module.CheckpointManager(root)
    manager.save(1, {"actor": worker}, {"global_steps": 1})
    real = module.rng_state
    module.rng_state = lambda: (_ for _ in ()).throw(OSError("disk full (simulated)"))
    failed = None
    try:
        manager.save(2, {"actor": worker}, {"global_steps": 2})
    except OSError as e:
        failed = str(e)
    finally:
        module.rng_state = real
    left = sorted(os.listdir(root))
    latest = manager.latest()
    state = manager.load(latest, {"actor": worker})
    manager.save(3, {"actor": worker}, {"global_steps": 3})
    return dict(failed=failed, left=left, latest=latest, state=state,
                after=sorted(os.listdir(root)))


def test_failed_save_leaves_previous_checkpoint_usable(tmp_path):
    res = run_on_ranks(_save_and_fail, 2, str(tmp_path))[0]
    assert res["failed"] == "disk full (simulated)"
    assert ".tmp-step_2" in res["left"] and "global_step_2" not in res["left"]
    assert res["latest"] == str(tmp_path / "global_step_1")
    assert res["state"] == {"global_steps": 1}
    assert res["after"] == ["global_step_1", "global_step_3", "latest_checkpointed_iteration.txt"]


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from engine.checkpoint import manager as module
    manager = module.CheckpointManager({ckpt!r})
    manager.save(1, {{}}, {{"global_steps": 1}})
    real = module.write_manifest
    def die(directory, *args):
        real(directory, *args)  # the new checkpoint is fully written, only the rename is missing
        os.kill(os.getpid(), signal.SIGKILL)
    module.write_manifest = die
    manager.save(2, {{}}, {{"global_steps": 2}})
""")


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    from engine.checkpoint import CheckpointManager

    ckpt = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE.format(root=ROOT, ckpt=ckpt)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert sorted(os.listdir(ckpt)) == [".tmp-step_2", "global_step_1",
                                        "latest_checkpointed_iteration.txt"]
    manager = CheckpointManager(ckpt)
    assert manager.latest() == os.path.join(ckpt, "global_step_1")
    assert manager.resolve("auto") == manager.latest()
    assert manager.load(manager.latest(), {}) == {"global_steps": 1}
    manager.save(3, {}, {"global_steps": 3})
    assert sorted(os.listdir(ckpt)) == ["global_step_1", "global_step_3",
                                        "latest_checkpointed_iteration.txt"]


def test_keep_last_deletes_older_checkpoints_after_the_new_one(tmp_path):
    from engine.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path), keep_last=2)
    for step in (10, 20, 30, 40):
        manager.save(step, {}, {"global_steps": step})
    assert manager.complete_steps() == [30, 40]
    assert sorted(os.listdir(tmp_path)) == ["global_step_30", "global_step_40",
                                            "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "40\n"
    assert manager.load(manager.latest(), {}) == {"global_steps": 40}
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_rng_round_trip_without_workers(tmp_path):
    from engine.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {}, {"global_steps": 1})
    expected = _draws()
    _draws()
    manager.load(manager.latest(), {})
    got = _draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_file_is_named(tmp_path, damage):
    from engine.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    path = manager.save(1, {}, {"global_steps": 1, "blob": list(range(1000))})
    target = os.path.join(path, "trainer_state.pt")
    data = bytearray(open(target, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        open(target, "wb").write(bytes(data))
    elif damage == "truncate":
        open(target, "wb").write(bytes(data[:-10]))
    else:
        os.remove(target)
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        manager.load(path, {})


def test_resolve_modes(tmp_path):
    from engine.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path / "run"))
    assert manager.latest() is None
    assert manager.resolve("auto") is None
    path = manager.save(5, {}, {"global_steps": 5})
    assert manager.resolve("auto") == path
    assert manager.resolve("disable") is None
    assert manager.resolve("resume_path", path) == path
    with pytest.raises(ValueError, match="does not exist"):
        manager.resolve("resume_path", str(tmp_path / "nowhere"))
    incomplete = tmp_path / "run" / "global_step_9"
    incomplete.mkdir()
    assert manager.latest() == path  # a directory without a manifest is not a checkpoint
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        manager.resolve("resume_path", str(incomplete))
    with pytest.raises(ValueError, match="resume_mode='sometimes'"):
        manager.resolve("sometimes")


def _adam_states(worker):
    """Every parameter's Adam state (moments and step count), in parameter order."""
    inner = getattr(worker.optimizer, "optimizer", worker.optimizer)
    return [{k: torch.as_tensor(v).clone() for k, v in inner.state.get(p, {}).items()}
            for group in inner.param_groups for p in group["params"]]


def _optimizer_state_after_two_updates(dist_opt, tmp):
    """Save after two optimizer steps, load into a fresh worker: every Adam state (moments and
    the step count that drives bias correction) must come back exactly."""
    from engine.checkpoint import CheckpointManager
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    actor_cfg, _, model_cfg = make_configs()
    actor_cfg = dataclasses.replace(actor_cfg, megatron=dataclasses.replace(
        actor_cfg.megatron, use_distributed_optimizer=dist_opt))

    def make():
        worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
        worker.mini_batch_size_per_rank = 4
        return worker

    trained = make()
    batch = make_batch(hf.vocab_size)
    old = trained.compute_log_prob(batch, micro_batch_size=4)
    batch["old_log_probs"], batch["ref_log_prob"] = old, old
    trained.update_policy(batch)
    trained.update_policy(batch)
    manager = CheckpointManager(tmp)
    manager.save(1, {"actor": trained}, {"x": 1})
    restored = make()
    manager.load(manager.latest(), {"actor": restored})
    return _adam_states(trained), _adam_states(restored)


@pytest.mark.parametrize("dist_opt", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_adam_state_and_step_count_survive_a_round_trip(dist_opt, tmp_path):
    saved, loaded = run_on_ranks(_optimizer_state_after_two_updates, 1, dist_opt, str(tmp_path))[0]
    assert saved and all(state for state in saved), "every parameter has Adam state after two steps"
    assert len(loaded) == len(saved)
    for i, (a, b) in enumerate(zip(saved, loaded)):
        assert a.keys() == b.keys(), i
        for key in a:
            assert torch.equal(a[key], b[key]), (i, key)
