"""Verified checkpoints: a damaged or incomplete newest checkpoint is detected and resume falls
back to the previous good one; non-finite models are never saved; everything loads with
torch.load(weights_only=True).

The multi-rank tests save and load through megatron's dist_checkpointing on 2 gloo ranks and
damage the real files it wrote.
"""
import json
import logging
import os
import random
import zlib

import numpy as np
import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_checkpoint import actor_weights, make_actor, ppo_step


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _biggest_file(directory):
    files = [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names]
    return max(files, key=os.path.getsize)


def _damage(path, how):
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.remove(path)


def _fallback_run(root):
    """Save steps 1 and 2; damage step 2 three ways (truncated model file, flipped bytes, no
    manifest); each time resume(auto) must pick step 1 with a warning. Then load it."""
    import torch.distributed as dist

    from engine.checkpoint import CheckpointError, CheckpointManager
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    worker = make_actor()
    ppo_step(worker, seed=3)
    manager = CheckpointManager(root)
    manager.save(1, {"actor": worker}, {"global_steps": 1, "rng": np.random.get_state()})
    at_step_1 = actor_weights(worker)
    ppo_step(worker, seed=4)
    handler = _Warnings()
    logging.getLogger("engine.checkpoint.manager").addHandler(handler)
    out = {"resolved": {}, "warnings": {}, "direct": {}}
    try:
        for how in ("truncate", "flip", "manifest"):
            path = manager.save(2, {"actor": worker}, {"global_steps": 2})
            out.setdefault("intact", manager.resolve("auto"))
            target = (os.path.join(path, "manifest.json") if how == "manifest"
                      else _biggest_file(os.path.join(path, "actor")))
            if dist.get_rank() == 0:
                _damage(target, "delete" if how == "manifest" else how)
            dist.barrier()
            handler.messages.clear()
            out["resolved"][how] = manager.resolve("auto")
            out["warnings"][how] = list(handler.messages)
            if how != "manifest":
                try:
                    manager.load(path, {"actor": worker})
                except CheckpointError as e:
                    out["direct"][how] = (os.path.relpath(target, root), str(e))
        fresh = make_actor(weight_salt="-other")
        state = manager.load(manager.resolve("auto"), {"actor": fresh})
    finally:
        logging.getLogger("engine.checkpoint.manager").removeHandler(handler)
    out.update(at_step_1=at_step_1, loaded=actor_weights(fresh), state=state)
    return out


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    results = run_on_ranks(_fallback_run, 2, str(tmp_path))
    step1, step2 = str(tmp_path / "global_step_1"), str(tmp_path / "global_step_2")
    for rank, res in enumerate(results):
        assert res["intact"] == step2  # before the damage the newest one is taken
        assert res["resolved"] == {"truncate": step1, "flip": step1, "manifest": step1}
        for name, tensor in res["at_step_1"].items():
            assert torch.equal(res["loaded"][name], tensor), name
        assert res["state"]["global_steps"] == 1
        assert isinstance(res["state"]["rng"][1], np.ndarray)  # numpy state comes back as numpy
    warnings = results[0]["warnings"]
    assert any("global_step_2 is unusable" in w and "bytes, its manifest says" in w
               for w in warnings["truncate"]), warnings["truncate"]
    assert any("does not match the crc32" in w for w in warnings["flip"]), warnings["flip"]
    assert any("global_step_2" in w and "incomplete" in w for w in warnings["manifest"]), warnings
    assert all(any("resuming from" in w and step1 in w for w in warnings[k]) for k in ("truncate", "flip"))
    for how in ("truncate", "flip"):  # loading the damaged one directly names the file
        rel, message = results[0]["direct"][how]
        assert rel in message.replace(str(tmp_path) + os.sep, ""), (rel, message)


def _non_finite_run(root, where):
    import torch.distributed as dist

    from engine.checkpoint import CheckpointManager, NonFiniteError
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    worker = make_actor()
    ppo_step(worker, seed=3)
    manager = CheckpointManager(root)
    manager.save(1, {"actor": worker}, {"global_steps": 1})
    if dist.get_rank() == 1:  # one rank only: every rank must refuse together
        with torch.no_grad():
            if where == "weight":
                next(worker.models[0].parameters()).view(-1)[0] = float("nan")
            else:
                inner = getattr(worker.optimizer, "optimizer", worker.optimizer)
                state = next(s for s in inner.state.values() if "exp_avg_sq" in s)
                state["exp_avg_sq"].view(-1)[-1] = float("inf")
    error = None
    try:
        manager.save(2, {"actor": worker}, {"global_steps": 2})
    except NonFiniteError as e:
        error = str(e)
    return dict(error=error, entries=sorted(os.listdir(root)), latest=manager.resolve("auto"))


@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_non_finite_values_are_never_saved(tmp_path, where):
    results = run_on_ranks(_non_finite_run, 2, str(tmp_path), where)
    for res in results:
        assert res["error"] is not None, "the save must be refused on every rank"
        assert "refusing to save step 2" in res["error"] and "rank 1" in res["error"]
        assert ("parameter '" if where == "weight" else "optimizer state 'exp_avg_sq'") in res["error"]
        assert res["entries"] == ["global_step_1", "latest_checkpointed_iteration.txt"]
        assert res["latest"] == str(tmp_path / "global_step_1")


# -- one process (no workers): the trainer state, RNG files, the manifest ----------------------
def _trainer_like_state():
    """A trainer-like state holding numpy values (RNG states, scalars) and plain values."""
    return {"step": 3, "loader": {"epoch": 0, "batches_done": 2}, "kl_ctrl": {"value": 0.1},
            "kl_guard": None, "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                                      "torch": torch.get_rng_state()},
            "scalars": [np.float32(0.5), np.int64(7)]}


def test_trainer_state_round_trips_through_weights_only_files(tmp_path):
    from engine.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    state = _trainer_like_state()
    path = manager.save(1, {}, state)
    for rel in ("trainer_state.pt", "rng/rank_0.pt"):  # no numpy global inside: plain torch reads it
        torch.load(os.path.join(path, rel), weights_only=True)
    back = manager.load(manager.resolve("auto"), {})
    assert back["rng"]["python"] == state["rng"]["python"]
    kind, keys, pos, has_gauss, gauss = back["rng"]["numpy"]
    assert kind == "MT19937" and keys.dtype == np.uint32
    assert np.array_equal(keys, state["rng"]["numpy"][1])
    assert (pos, has_gauss, gauss) == tuple(state["rng"]["numpy"][2:])
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert type(back["scalars"][0]) is np.float32 and back["scalars"] == state["scalars"]
    np.random.set_state(back["rng"]["numpy"])  # the restored state works as numpy's
    first = np.random.rand(3)
    np.random.set_state(state["rng"]["numpy"])
    assert np.array_equal(first, np.random.rand(3))


def test_unsafe_trainer_state_is_refused_before_writing(tmp_path):
    from engine.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {}, {"step": 1})
    with pytest.raises(CheckpointError, match=r"trainer_state\['extra'\]\['cb'\] is a builtins.object"):
        manager.save(2, {}, {"step": 2, "extra": {"cb": object()}})
    assert manager.complete_steps() == [1] and manager.resolve("auto").endswith("global_step_1")


def test_fallback_order_and_no_usable_checkpoint(tmp_path, caplog):
    from engine.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(str(tmp_path))
    for step in (1, 2, 3):
        manager.save(step, {}, {"step": step, "pad": list(range(500))})
    _damage(str(tmp_path / "global_step_3" / "trainer_state.pt"), "truncate")
    os.remove(tmp_path / "global_step_2" / "manifest.json")
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.manager"):
        assert manager.resolve("auto") == str(tmp_path / "global_step_1")
    text = caplog.text
    assert "global_step_2" in text and "incomplete" in text
    assert "global_step_3 is unusable" in text and "trainer_state.pt" in text
    assert manager.load(manager.resolve("auto"), {})["step"] == 1
    with pytest.raises(CheckpointError, match=r"resume_from_path=.*global_step_3.*trainer_state.pt"):
        manager.resolve("resume_path", str(tmp_path / "global_step_3"))
    _damage(str(tmp_path / "global_step_1" / "meta.json"), "flip")
    with pytest.raises(CheckpointError, match="no usable checkpoint .*resume_mode=disable"):
        manager.resolve("auto")


def test_size_only_verification_misses_flips_checksums_catch_them(tmp_path):
    from engine.checkpoint import CheckpointError, CheckpointManager

    path = CheckpointManager(str(tmp_path)).save(1, {}, {"blob": list(range(2000))})
    _damage(os.path.join(path, "trainer_state.pt"), "flip")
    assert CheckpointManager(str(tmp_path), verify="size").resolve("auto") == path
    with pytest.raises(CheckpointError, match="does not match the crc32"):
        CheckpointManager(str(tmp_path)).load(path, {})
    with pytest.raises(ValueError, match="trainer.checkpoint_verify='fast'"):
        CheckpointManager(str(tmp_path), verify="fast")


def test_every_file_is_fsynced_before_the_manifest(tmp_path, monkeypatch):
    """Durability order: each file's data (and its directory) reach the disk, then the manifest."""
    from engine.checkpoint import manager as module

    events = []
    real_fsync, real_manifest = os.fsync, module.write_manifest

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def manifest(directory, *args):
        events.append(("manifest", directory))
        return real_manifest(directory, *args)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(module, "write_manifest", manifest)
    path = module.CheckpointManager(str(tmp_path)).save(4, {}, {"step": 4})
    at = events.index(("manifest", str(tmp_path / ".tmp-step_4")))
    synced = {p for kind, p in events[:at] if kind == "fsync"}
    for rel in json.load(open(os.path.join(path, "manifest.json")))["files"]:
        assert str(tmp_path / ".tmp-step_4" / rel) in synced, rel
    assert str(tmp_path / ".tmp-step_4" / "rng") in synced


def test_checksums_stream_in_blocks_and_older_sha256_manifests_verify(tmp_path):
    from engine.checkpoint import files as cf

    data = os.urandom(cf.BLOCK * 2 + 12345)  # crosses block boundaries
    (tmp_path / "big.bin").write_bytes(data)
    assert cf.file_checksum(str(tmp_path / "big.bin")) == f"{zlib.crc32(data):08x}"
    import hashlib
    manifest = {"version": 1, "files": {"big.bin": {"size": len(data),
                                                    "sha256": hashlib.sha256(data).hexdigest()}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cf.verify_manifest(str(tmp_path))
    _damage(str(tmp_path / "big.bin"), "flip")
    with pytest.raises(cf.CheckpointError, match="does not match the sha256"):
        cf.verify_manifest(str(tmp_path))


# -- what is divided over ranks is checked in every rank's part -------------------------------
def _shares_run(root):
    """Each rank writes nothing; rank 0 lays out files of distinct sizes and a manifest built by
    the ranks together. Then, for every rank r, one file of rank r's share is damaged (a byte
    flipped: sizes still match) and every rank must report that file."""
    import torch.distributed as dist

    from engine.checkpoint import files as cf

    directory = os.path.join(root, "ckpt")
    if dist.get_rank() == 0:
        os.makedirs(directory)
        for i in range(7):
            with open(os.path.join(directory, f"part_{i}.bin"), "wb") as f:
                f.write(bytes([i]) * (1000 + 300 * i))
    dist.barrier()
    files = cf.make_durable(directory)
    entries = cf.manifest_entries(directory, files)
    if dist.get_rank() == 0:
        cf.write_manifest(directory, entries)
    dist.barrier()
    out = {"entries": entries, "intact": cf.verify_checkpoint(directory, "checksum"), "damaged": {}}
    for owner in range(dist.get_world_size()):
        rel = cf.share(files, owner, dist.get_world_size())[-1]  # the smallest file of that share
        if dist.get_rank() == 0:
            _damage(os.path.join(directory, rel), "flip")
        dist.barrier()
        out["damaged"][owner] = (rel, cf.verify_checkpoint(directory, "checksum"),
                                 cf.verify_checkpoint(directory, "size"))
        if dist.get_rank() == 0:
            _damage(os.path.join(directory, rel), "flip")  # flipped back
        dist.barrier()
    return out


def test_checkpoint_checks_cover_every_ranks_share(tmp_path):
    """Manifest checksums and verification are split over ranks: a flipped byte in any rank's
    part is found, and the manifest the ranks build equals the one-process manifest."""
    from engine.checkpoint import files as cf

    results = run_on_ranks(_shares_run, 2, str(tmp_path))
    directory = str(tmp_path / "ckpt")
    files = cf.list_files(directory)
    alone = {rel: {"size": size, "crc32": cf.file_checksum(os.path.join(directory, rel))}
             for rel, size in files}
    shares = [set(cf.share(files, r, 2)) for r in range(2)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    for res in results:
        assert res["entries"] == alone
        assert res["intact"] is None
        for owner in (0, 1):
            rel, problem, size_only = res["damaged"][owner]
            assert rel in shares[owner]
            assert problem is not None and rel in problem and "does not match the crc32" in problem
            assert size_only is None  # a flip keeps the size: only checksums see it
