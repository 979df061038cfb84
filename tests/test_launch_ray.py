"""engine.launch_ray: the tiny recipe under Ray (2 CPU ranks as actors) gives torchrun's metrics
step for step; a rank killed mid-run ends the job within a bounded time with a report naming it;
ranks are numbered node by node with torchrun's environment; a separate rollout pool gets a
placement group of its own, and a pool rank killed mid-run is restarted and the run finishes
with torchrun's metrics."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.launch_ray import Launch, Placement, assign_ranks
from tests.test_e2e import GRPO_RUN, GRPO_STEPS, ROOT, TINY, read_records

VARYING = ("timing_s/", "perf/")  # wall-clock and memory figures differ run to run


@pytest.fixture(scope="module")
def ray_ok():
    import ray  # noqa: F401  (the dev extra installs it: a missing Ray fails here, never skips)
    probe = ("import ray; ray.init(address='local', num_cpus=1, include_dashboard=False, "
             "log_to_driver=False); "
             "ray.shutdown()")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("Ray did not start within 180 s here")
    if done.returncode != 0:
        pytest.fail(f"Ray cannot start here: {done.stderr.strip()[-300:]}")


def _ray_cmd(tmp_path, name, steps, extra=()):
    return [sys.executable, "-m", "engine.launch_ray", os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"),
            *TINY, f"trainer.total_training_steps={steps}", f"trainer.experiment_name={name}",
            f"trainer.default_local_dir={tmp_path}/ckpt/{name}",
            f"trainer.log_dir={tmp_path}/logs/{name}", *extra]


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)


def test_ray_run_gives_torchrun_metrics(tmp_path, ray_ok, grpo_run):
    """The torchrun side is the shared GRPO run (tests/conftest.py): 4 steps, checkpoints at 2
    and 4, validation at 4; the Ray run takes the same settings."""
    _, _, torchrun = grpo_run
    done = subprocess.run(_ray_cmd(tmp_path, "ray", GRPO_STEPS, GRPO_RUN), cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"[rank 0] step {GRPO_STEPS}/{GRPO_STEPS}" in done.stdout  # rank-prefixed logs reach the driver
    ray = read_records(tmp_path, "ray")
    assert [r["step"] for r in ray] == [r["step"] for r in torchrun] == list(range(1, GRPO_STEPS + 1))
    for a, b in zip(torchrun, ray):
        keys = {k for k in a if not k.startswith(VARYING)}
        assert keys == {k for k in b if not k.startswith(VARYING)}
        assert "actor/pg_loss" in keys and ("val/score/mean" in keys) == (a["step"] == GRPO_STEPS)
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-12), (a["step"], k)


def _reader(proc, lines):
    for line in proc.stdout:
        lines.append(line)


@pytest.mark.slow  # 15 s; a rank that fails is test_a_ranks_mistake_is_reported_with_its_phase_and_line
def test_killed_rank_ends_the_job_with_a_report(tmp_path, ray_ok):
    import psutil
    proc = subprocess.Popen(_ray_cmd(tmp_path, "killed", 500, ["trainer.save_freq=-1",
                                                               "trainer.test_freq=-1"]),
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 400
        while not any("[rank 0] step 2/500" in ln for ln in lines):  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        pids = {int(ln.split("pid ")[1].split()[0]): int(ln.split("rank ")[1].split(":")[0])
                for ln in lines if ln.startswith("[launch_ray] rank ")}
        victim = next(pid for pid, rank in pids.items() if rank == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=60)  # the bound: the job is over within a minute of the death
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    out = "".join(lines)
    assert proc.returncode == 1, out[-3000:]
    report = [ln for ln in out.splitlines() if "FAILED: rank 1 " in ln]
    assert report, out[-3000:]
    assert "phase '" in report[0] and f"pid {victim}" in report[0]
    assert "stopped rank(s) [0]" in out or "then rank 0 " in out  # rank 0 killed, or failed after
    survivor = next(pid for pid, rank in pids.items() if rank == 0)
    assert not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE
    print(f"\njob ended {took:.1f} s after rank 1 was killed:\n"
          + "\n".join(ln for ln in out.splitlines() if ln.startswith("[launch_ray]")))


# ~15 s; make test keeps test_ray_run_gives_torchrun_metrics (and tests/test_faults.py: a rank's
# mistake under torchrun)
@pytest.mark.slow
def test_a_ranks_mistake_is_reported_with_its_phase_and_line(tmp_path, ray_ok):
    missing = str(tmp_path / "no_such_tokenizer")  # valid config, found missing by the ranks
    done = subprocess.run(_ray_cmd(tmp_path, "raises", 2,
                                   [f"actor_rollout_ref.model.tokenizer_path={missing}"]),
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    report = [ln for ln in out.splitlines() if "[launch_ray] FAILED: rank " in ln]
    assert report and "in phase 'startup'" in report[0] and "no_such_tokenizer" in report[0], out[-3000:]
    # a user's mistake is the rank's one `error:` line (engine/errors.py), prefixed, no traceback
    assert "[rank 0] error: actor_rollout_ref.model.tokenizer_path=" in out and "Traceback" not in out


def test_ranks_are_numbered_node_by_node_with_each_nodes_gpus():
    # two nodes of 4 GPUs, bundles granted in a scattered order
    spots = [("b", "10.0.0.2", 3), ("a", "10.0.0.1", 1), ("b", "10.0.0.2", 0), ("a", "10.0.0.1", 0),
             ("a", "10.0.0.1", 3), ("b", "10.0.0.2", 2), ("a", "10.0.0.1", 2), ("b", "10.0.0.2", 1)]
    placements = [Placement(i, node, ip, (str(g),), 100 + i) for i, (node, ip, g) in enumerate(spots)]
    ranked = assign_ranks(placements, 4, gpu=True)
    assert [p.node_ip for p, _ in ranked] == ["10.0.0.2"] * 4 + ["10.0.0.1"] * 4  # bundle 0's node first
    assert [p.gpu_ids[0] for p, _ in ranked] == ["0", "1", "2", "3"] * 2
    for rank, (p, env) in enumerate(ranked):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "8"
        assert env["LOCAL_RANK"] == str(rank % 4) and env["GROUP_RANK"] == str(rank // 4)
        # the node's GPUs in local-rank order: device LOCAL_RANK is this rank's own GPU
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[rank % 4] == p.gpu_ids[0]
    cpu = assign_ranks([Placement(i, "n", "1.2.3.4", (), i) for i in range(2)], 2, gpu=False)
    assert [e["LOCAL_RANK"] for _, e in cpu] == ["0", "1"] and "CUDA_VISIBLE_DEVICES" not in cpu[0][1]
    uneven = placements[:3] + [Placement(9, "c", "10.0.0.3", ("0",), 9)]
    with pytest.raises(ValueError, match="trainer.n_gpus_per_node=2"):
        assign_ranks(uneven, 2, gpu=True)


def test_training_ranks_and_the_pool_get_placement_groups_of_their_own(ray_ok):
    """2 training + 2 pool ranks: each set in its own placement group (as each actor reports
    it), training ranks first, bundles 0 and 1 of each; the pool's actors may be restarted."""
    import ray
    # 2 CPUs beyond the 4 bundles: an actor placed outside its group would still start (and be seen)
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    launch = Launch(["recipe.yaml"], 4, 4, False, 1, 1, 120, pool=2, max_restarts=1)
    try:
        launch.start()
        placed = [p for _, p, _ in launch.ranks]
        train_pg, pool_pg = (pg.id.hex() for pg in launch.pgs)
        assert [p.role for p in placed] == ["train", "train", "rollout", "rollout"]
        assert [p.group for p in placed] == [train_pg, train_pg, pool_pg, pool_pg] and train_pg != pool_pg
        assert [p.bundle for p in placed] == [0, 1, 0, 1] and len({p.pid for p in placed}) == 4
        assert [env["RANK"] for _, _, env in launch.ranks] == ["0", "1", "2", "3"]
        table = ray.util.placement_group_table()
        assert len(table[train_pg]["bundles"]) == len(table[pool_pg]["bundles"]) == 2
        assert all(env["TRIDENT_LAUNCHER"] == "ray" for _, _, env in launch.ranks)
    finally:
        launch.stop()
        ray.shutdown()


def test_the_pools_ranks_come_after_the_training_ranks():
    """Whatever GPUs the two placement groups got on a node: training ranks first, each rank's
    own GPU at its LOCAL_RANK in CUDA_VISIBLE_DEVICES."""
    spots = [Placement(0, "n", "1", ("0",), 10, "rollout"), Placement(0, "n", "1", ("3",), 11, "train"),
             Placement(1, "n", "1", ("2",), 12, "train"), Placement(1, "n", "1", ("1",), 13, "rollout")]
    ranked = assign_ranks(spots, 4, gpu=True)
    assert [p.pid for p, _ in ranked] == [12, 11, 10, 13]  # training by GPU, then the pool by GPU
    assert all(env["CUDA_VISIBLE_DEVICES"] == "2,3,0,1" for _, env in ranked)


POOL_RESTART = ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2",
                "trainer.rollout_pool_max_restarts=1"]
# pool rank 3 dies after its 2nd generation (step 2's share), in its first process only
KILL_POOL_RANK = json.dumps([{"kind": "kill", "phase": "pool_generate", "call": 2, "incarnation": 0,
                              "rank": 3}])


@pytest.mark.slow  # ~2 min; fast siblings: tests/test_bridge.py (the rejoin), the placement test above
def test_a_killed_pool_rank_is_restarted_and_the_run_finishes(tmp_path, ray_ok, grpo_run):
    """2 training + 2 pool ranks (k = 0, the pool trains as colocated, tests/test_rollout_pool.py):
    pool rank 3 is SIGKILLed after generating its share of step 2, before sending it; Ray brings
    it back, it gets the weights again and generates that share again: every step is logged with
    the colocated torchrun run's metrics (the shared GRPO run), validation at step 4 included."""
    _, _, torchrun = grpo_run
    done = subprocess.run(_ray_cmd(tmp_path, "restart", GRPO_STEPS, GRPO_RUN + POOL_RESTART), cwd=tmp_path,
                          env=_env(TRIDENT_FAULTS=KILL_POOL_RANK), capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    died = [ln for ln in out.splitlines() if "[launch_ray] rank 3 (rollout pool) died" in ln]
    assert len(died) == 1 and "restarting it (1 of 1)" in died[0], out[-4000:]
    first = next(ln for ln in out.splitlines() if ln.startswith("[launch_ray] rank 3: "))
    again = next(ln for ln in out.splitlines() if ln.startswith("[launch_ray] rank 3 restarted: "))
    assert first.split("pid ")[1].split()[0] != again.split("pid ")[1].split()[0]  # a new process
    assert "rollout pool bundle 1" in first and "rollout pool bundle 1" in again  # in its own bundle
    assert "all 4 ranks finished; rank 3 restarted 1 time(s)" in out
    ray = read_records(tmp_path, "restart")
    assert [r["step"] for r in ray] == [r["step"] for r in torchrun] == list(range(1, GRPO_STEPS + 1))
    for a, b in zip(torchrun, ray):  # the regenerated share is the one the dead rank made
        for key in ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
                    "response_length/mean", "val/score/mean"):
            assert (key in a) == (key in b) == (key != "val/score/mean" or a["step"] == GRPO_STEPS)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-12), (a["step"], key)


RESTART = ["trainer.n_gpus_per_node=4", "trainer.rollout_pool_max_restarts=1"]
SEPARATE = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2"]


@pytest.mark.parametrize("extra, says", [
    (["trainer.rollout_pool_max_restarts=-1"], "=-1: must be >= 0"),
    (RESTART, "=1: only a separate pool's ranks are restarted"),
    (RESTART + SEPARATE + ["trainer.off_policy_steps=1", "trainer.partial_rollout=true"],
     "=1: not with trainer.partial_rollout"),
    (RESTART + SEPARATE + ["trainer.off_policy_steps=1", "data.gen_batch_size=12"],
     "=1: not with streaming groups yet"),
    (RESTART + SEPARATE + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     r"=1: a replacement rejoins single-rank engines only, not actor_rollout_ref\.rollout\."
     "tensor_model_parallel_size=2"),
    (RESTART + SEPARATE + ["trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang"],
     "=1: not with rollout backend 'sglang'"),
])
def test_restarts_are_refused_where_a_replacement_could_not_rejoin(extra, says):
    from engine.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="^trainer.rollout_pool_max_restarts" + says):
        load_config(os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), [*TINY, *extra])


def test_restarts_are_refused_under_torchrun(monkeypatch):
    """Only engine.launch_ray restarts a pool rank; under torchrun the key is refused before any
    process group or store."""
    from engine.config import load_config
    from engine.errors import UsageError
    from engine.train import open_pool
    cfg = load_config(os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), [*TINY, *RESTART, *SEPARATE])
    monkeypatch.delenv("TRIDENT_LAUNCHER", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match="only python -m engine.launch_ray restarts a dead pool rank"):
        open_pool(cfg)
