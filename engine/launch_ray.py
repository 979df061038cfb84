"""`python -m engine.launch_ray RECIPE.yaml [key=value ...] [--address HOST:PORT]`

The SPMD ranks `torchrun -m engine.train` starts, started as Ray actors instead: same recipe,
same code path (each actor calls `engine.train.main(argv)`), same results.

- Cluster: `--address` or RAY_ADDRESS connects to a running one; without either a local Ray
  is started (no dashboard) with enough CPUs for the ranks.
- Placement: one bundle per rank, trainer.nnodes x trainer.n_gpus_per_node of them:
  {"GPU": 1, "CPU": k} on GPUs, {"CPU": 1} on CPU (trainer.device, or what the cluster has
  when it is 'auto'); STRICT_PACK on one node, PACK over several. Resource pools (verl's
  resource-pool idea): with trainer.rollout_pool=separate the training ranks and the
  trainer.rollout_pool_ranks pool ranks get a placement group each, so no bundle (GPU) holds
  both; each actor reports its placement group. Ranks are numbered training ranks first, node by
  node (GPU order within a node), and every n_gpus_per_node consecutive ranks must share a
  node, because the rollout topology (engine/rollout/topology.py) takes local rank = GPU index.
- Rendezvous, as torchrun sets it: MASTER_ADDR (rank 0's node) and MASTER_PORT (free there),
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK; on GPUs CUDA_VISIBLE_DEVICES
  lists the node's GPUs of the job in local-rank order, so device LOCAL_RANK is the rank's own.
  Variables that steer the libraries (OMP_*, NCCL_*, TRIDENT_*, HF_* ...) are passed on.
- Logs: each actor captures its stdout / stderr (file descriptors, so C libraries and child
  processes too) and the driver prints them as "[rank R] ...".
- Failure: when a rank raises, exits non-zero or dies (killed, OOM, node lost), the others are
  killed at once and the driver reports the rank, its phase (engine.phase: the trainer's
  current phase) and the error, and exits 1.
- Restart: a rollout pool rank that dies (not one that raises) is restarted in its bundle, up
  to trainer.rollout_pool_max_restarts times, while training goes on: the new process rejoins
  over the store bridge (engine/rollout/bridge.py), gets the weights re-sent and answers the
  requests the dead one had not.

The code must be importable on every node at the same path (it is put on PYTHONPATH). Ray 2.60
clusters started with token authentication need the token here too (RAY_AUTH_TOKEN or its file).

Tests: tests/test_launch_ray.py
"""
import argparse
import collections
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORWARDED_ENV = ("OMP_", "MKL_", "OPENBLAS_", "TRIDENT_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_",
                 "TORCHINDUCTOR_", "TRITON_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_",
                 "MLFLOW_", "CUDA_LAUNCH_BLOCKING", "CUBLAS_")
KILL_WAIT_S = 15.0  # how long the driver waits for killed ranks to be gone
GRACE_S = 3.0  # after a first failure, how long to watch for the one that caused it


@dataclass(frozen=True)
class Placement:
    """Where one actor runs (reported by the actor itself)."""
    bundle: int
    node_id: str
    node_ip: str
    gpu_ids: Tuple[str, ...]
    pid: int
    role: str = "train"  # or "rollout": the resource pool (placement group) it was placed in
    group: str = ""  # the id of the placement group the actor runs in, as the actor sees it


ROLES = ("train", "rollout")  # resource pools, in rank order


def assign_ranks(placements: Sequence[Placement], per_node: int,
                 gpu: bool) -> List[Tuple[Placement, Dict[str, str]]]:
    """(placement, rendezvous environment without MASTER_*) of rank 0, 1, ...: node by node in
    the order the nodes first appear among the bundles, by GPU id within a node."""
    order = {}
    for p in sorted(placements, key=lambda p: (ROLES.index(p.role), p.bundle)):
        order.setdefault(p.node_id, len(order))
    ranked = sorted(placements, key=lambda p: (ROLES.index(p.role), order[p.node_id], tuple(
        int(g) for g in p.gpu_ids if str(g).isdigit()), p.bundle))
    world = len(ranked)
    if world % per_node:
        raise ValueError(f"{world} ranks do not fill nodes of trainer.n_gpus_per_node={per_node}")
    out = []
    for start in range(0, world, per_node):
        group = ranked[start:start + per_node]
        nodes = {p.node_ip for p in group}
        if len(nodes) > 1:
            raise ValueError(
                f"ranks {start}..{start + per_node - 1} landed on nodes {sorted(nodes)}, but every "
                f"trainer.n_gpus_per_node={per_node} consecutive ranks must share a node (the rollout "
                "topology takes local rank = GPU index); set trainer.n_gpus_per_node to the GPUs each "
                "node gives this job, or free whole nodes")
        visible = ",".join(p.gpu_ids[0] for p in group) if gpu else None
        for local, p in enumerate(group):
            env = dict(RANK=str(start + local), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(start // per_node))
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            out.append((p, env))
    return out


def forwarded_env(environ=None) -> Dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV)}


# ----------------------------------------------------------------------------- the rank actor
class _Capture:
    """This process's stdout / stderr, at the file-descriptor level, as lines (and still in the
    worker's own log file)."""

    def __init__(self):
        self.lines = collections.deque()
        self.cond = threading.Condition()
        self.saved = None
        self.last = ""  # the last non-empty line, whether or not the driver has taken it

    def start(self):
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()

    def _pump(self, fd):
        pending = b""
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            os.write(self.saved[0], chunk)
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self._add(complete)
        self._add([pending] if pending else [])
        os.close(fd)

    def _add(self, raw):
        if raw:
            text = [r.decode(errors="replace") for r in raw]
            with self.cond:
                self.lines.extend(text)
                self.last = next((t for t in reversed(text) if t.strip()), self.last)
                self.cond.notify_all()

    def stop(self):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        self.thread.join(timeout=5)  # a lingering child may hold the pipe: do not wait for it

    def take(self, timeout):
        with self.cond:
            if not self.lines:
                self.cond.wait(timeout)
            out = list(self.lines)
            self.lines.clear()
        return out


class _LeftJob(BaseException):
    """engine.train's os._exit(code) inside an actor: the rank leaves, the driver is told why."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class RankActor:
    """One SPMD rank. `run` executes engine.train.main; `poll` (another concurrency group)
    hands the driver its new log lines and current phase while `run` is busy."""

    def __init__(self):
        self.capture = _Capture()

    def where(self, bundle, role="train"):
        import ray
        ctx = ray.get_runtime_context()
        gpus = tuple(str(g) for g in ray.get_gpu_ids())
        return Placement(bundle, ctx.get_node_id(), ray.util.get_node_ip_address(), gpus, os.getpid(),
                         role, ctx.get_placement_group_id() or "")

    def free_port(self):
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, argv, env, cwd):
        os.environ.update(env)  # before torch is imported: CUDA_VISIBLE_DEVICES, OMP_* act
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative recipe paths (logs/, checkpoints/) as under torchrun
        from engine.phase import current_phase
        self.capture.start()
        real_exit, here = os._exit, (os.getpid(), threading.get_ident())

        def leave(code):  # engine.train leaves a failed collective by os._exit: report instead
            if (os.getpid(), threading.get_ident()) != here:  # a forked child, another thread
                real_exit(code)
            raise _LeftJob(code)
        os._exit = leave
        try:
            from engine.train import main
            code = main(list(argv))
            result = dict(rc=0 if code is None else int(code), error=None, left=False)
        except _LeftJob as e:  # an effect: a peer died or stopped answering (its line is logged)
            result = dict(rc=e.code or 1, error="left the job after a failed collective", left=True)
        except BaseException as e:  # the rank's failure, reported by the driver
            traceback.print_exc()
            code = e.code if isinstance(e, SystemExit) else None
            result = dict(rc=code if isinstance(code, int) and code else 1,
                          error=f"{type(e).__name__}: {e}".strip(), left=False)
        finally:
            os._exit = real_exit
            self.capture.stop()
        # engine.train's one line on what failed: after a failed collective, or a user's mistake
        # (main returned 2 having printed `error: ...`)
        if self.capture.last and (result["left"] or (result["rc"] and result["error"] is None)):
            result["error"] = self.capture.last.strip()[:600]
        result["phase"] = current_phase()
        return result

    def poll(self, timeout):
        from engine.phase import current_phase
        return self.capture.take(timeout), current_phase()


# ------------------------------------------------------------------------------------ driver
def _describe(error) -> str:
    """The first lines of a Ray error (an actor's death cause, an exception's message)."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    return " ".join(lines[:4])[:600] or type(error).__name__


class Launch:
    def __init__(self, argv, world, per_node, gpu, cpus_per_rank, nnodes, pg_timeout, pool=0, max_restarts=0):
        """pool: the last ranks that form the rollout pool (trainer.rollout_pool_ranks with a
        separate pool, else 0); max_restarts: how often one of them is restarted."""
        self.argv, self.world, self.per_node, self.gpu = list(argv), world, per_node, gpu
        self.cpus_per_rank, self.nnodes, self.pg_timeout = cpus_per_rank, nnodes, pg_timeout
        self.pool, self.max_restarts = pool, max_restarts
        self.actors, self.pgs = [], []

    def log(self, msg, err=False):
        print(f"[launch_ray] {msg}", file=sys.stderr if err else sys.stdout, flush=True)

    def start(self):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": self.cpus_per_rank} if self.gpu else {"CPU": 1}
        strategy = "STRICT_PACK" if self.nnodes == 1 else "PACK"
        pools = [n for n in (self.world - self.pool, self.pool) if n]  # training ranks, rollout pool
        self.pgs = [placement_group([dict(bundle)] * n, strategy=strategy) for n in pools]
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=self.pg_timeout)
        except ray.exceptions.GetTimeoutError:
            asked = " + ".join(f"{n} {role}" for role, n in zip(ROLES, pools))
            raise RuntimeError(
                f"the cluster did not grant {asked} bundles of {bundle} ({strategy}) within "
                f"{self.pg_timeout:.0f} s; it has {ray.available_resources()} free. Lower "
                "trainer.nnodes / trainer.n_gpus_per_node, or add nodes") from None
        # `run` holds the default group; where / free_port / poll answer meanwhile
        cls = ray.remote(concurrency_groups={"io": 2})(RankActor)
        asked = []
        for role, pg, n in zip(ROLES, self.pgs, pools):
            for i in range(n):
                strategy_i = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                # a pool rank comes back in its bundle; max_task_retries=0: its `run` fails, the
                # driver starts it again (engine/rollout/bridge.py: it resumes from its restart point)
                opts = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy_i,
                            max_restarts=self.max_restarts if role == "rollout" else 0, max_task_retries=0)
                self.actors.append(cls.options(**opts).remote())
                asked.append((role, i))
        placements = ray.get([a.where.options(concurrency_group="io").remote(i, role)
                              for a, (role, i) in zip(self.actors, asked)])
        ranked = assign_ranks(placements, self.per_node, self.gpu)
        by_bundle = {(p.role, p.bundle): a for p, a in zip(placements, self.actors)}
        self.ranks = [(by_bundle[p.role, p.bundle], p, env) for p, env in ranked]
        rank0, p0, _ = self.ranks[0]
        port = ray.get(rank0.free_port.options(concurrency_group="io").remote())
        for rank, (_, p, env) in enumerate(self.ranks):
            # TRIDENT_LAUNCHER: engine.train lets a pool rank be restarted only here
            env.update(forwarded_env(), MASTER_ADDR=p0.node_ip, MASTER_PORT=str(port), TRIDENT_LAUNCHER="ray")
            self.log(f"rank {rank}: node {p.node_ip} pid {p.pid}" + (f" gpu {p.gpu_ids[0]}" if self.gpu else "")
                     + (f" {p.role} pool bundle {p.bundle}" if self.pool else ""))

    def run(self) -> int:
        import ray
        self.start()
        runs = {a.run.remote(self.argv, env, os.getcwd()): r for r, (a, _, env) in enumerate(self.ranks)}
        phase = {r: "startup" for r in range(self.world)}
        polls = {r: self._poll(r) for r in range(self.world)}  # one outstanding poll per rank
        # rank -> (kind, phase, why); kind 0: the actor died, 1: main raised or returned an error,
        # 2: the rank left after a failed collective. The first failure opens a grace window.
        failed = {}
        until = None
        restarts = collections.Counter()
        while runs and (until is None or time.monotonic() < until):
            ready, _ = ray.wait(list(runs) + list(polls.values()), num_returns=1, timeout=0.5)
            for ref in ready:
                if ref not in runs:
                    rank = next(r for r, p in polls.items() if p == ref)
                    try:
                        lines, phase[rank] = ray.get(ref)
                    except ray.exceptions.RayError as e:  # the actor is gone
                        if not self._restarts(rank):  # else its `run` tells: restarted or failed
                            failed.setdefault(rank, (0, phase[rank], _describe(e)))
                        del polls[rank]
                        continue
                    self._print(rank, lines)
                    polls[rank] = self._poll(rank)
                    continue
                rank = runs.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:  # the actor died: killed, OOM, node lost
                    if not failed and restarts[rank] < self._restarts(rank):
                        restarts[rank] += 1
                        self.log(f"rank {rank} (rollout pool) died in phase '{phase[rank]}': {_describe(e)}; "
                                 f"restarting it ({restarts[rank]} of {self.max_restarts})", err=True)
                        runs[self._restart(rank)] = rank
                        polls[rank], phase[rank] = self._poll(rank), "restart"
                        continue
                    failed[rank] = (0, phase[rank], _describe(e))
                    continue
                self._drain(rank, polls.pop(rank))
                if result["rc"] != 0:
                    failed.setdefault(rank, (2 if result["left"] else 1, result["phase"],
                                             result["error"] or f"engine.train.main returned {result['rc']}"))
            if failed and until is None:
                until = time.monotonic() + GRACE_S
        if not failed:
            again = "".join(f"; rank {r} restarted {n} time(s)" for r, n in sorted(restarts.items()))
            self.log(f"all {self.world} ranks finished{again}")
            return 0
        # a rank that died, else one that raised, is the cause; peers that lost it are the effect
        rank = min(failed, key=lambda r: (failed[r][0], r))
        _, where, why = failed[rank]
        running = sorted(runs.values())
        self.stop(wait_for=list(runs))
        node = self.ranks[rank][1]
        self.log(f"FAILED: rank {rank} (node {node.node_ip}, pid {node.pid}) in phase '{where}': "
                 f"{why}", err=True)
        for other in sorted(set(failed) - {rank}):
            self.log(f"then rank {other} in phase '{failed[other][1]}': {failed[other][2]}", err=True)
        self.log(f"stopped rank(s) {running}; exit code 1", err=True)
        return 1

    def _restarts(self, rank):
        """How often `rank` may be restarted: a pool rank's max_restarts, a training rank never."""
        return self.max_restarts if rank >= self.world - self.pool else 0

    def _restart(self, rank):
        """Run the restarted actor of `rank` again (Ray brings its process back in its bundle):
        the same environment, so it meets the same store."""
        import ray
        actor, old, env = self.ranks[rank]
        deadline = time.monotonic() + self.pg_timeout
        while True:
            try:
                p = ray.get(actor.where.options(concurrency_group="io").remote(old.bundle, old.role),
                            timeout=self.pg_timeout)
                break
            except ray.exceptions.ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.ranks[rank] = (actor, p, env)
        self.log(f"rank {rank} restarted: node {p.node_ip} pid {p.pid} {p.role} pool bundle {p.bundle}")
        return actor.run.remote(self.argv, env, os.getcwd())

    def _poll(self, rank, timeout=1.0):
        return self.ranks[rank][0].poll.options(concurrency_group="io").remote(timeout)

    def _drain(self, rank, outstanding):
        """A finished rank's last lines: its outstanding poll's, then whatever is left."""
        import ray
        try:
            for ref in (outstanding, self._poll(rank, 0.0)):
                self._print(rank, ray.get(ref, timeout=10)[0])
        except ray.exceptions.RayError:
            pass

    def _print(self, rank, lines):
        if lines:
            sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            sys.stdout.flush()

    def stop(self, wait_for=()):
        """Kill every rank actor (and wait, bounded, for the given run refs to resolve)."""
        import ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        if wait_for:
            ray.wait(list(wait_for), num_returns=len(wait_for), timeout=KILL_WAIT_S)
        from ray.util.placement_group import remove_placement_group
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m engine.launch_ray",
                                description="Run engine.train's ranks as Ray actors.")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--cpus-per-rank", type=int, default=1, help="CPUs in each GPU rank's bundle")
    p.add_argument("--pg-timeout", type=float, default=600.0,
                   help="seconds to wait for the cluster to grant the placement group")
    args = p.parse_intermixed_args(argv)
    if args.cpus_per_rank < 1:
        p.error(f"--cpus-per-rank must be >= 1, got {args.cpus_per_rank}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from engine.config import load_config
    try:
        cfg = load_config(args.recipe, args.overrides)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    import ray
    address = args.address or os.environ.get("RAY_ADDRESS")
    path = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    common = dict(log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    if address:
        ray.init(address=address, **common)
    else:  # logical CPUs: one per rank whatever the machine has, and the reward workers' (a
        # rank's RewardManager starts reward_model.num_workers actors in this same cluster)
        # address="local": a new instance, never a cluster some earlier `ray start` left recorded
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world * args.cpus_per_rank)
                 + world * cfg.reward_model.num_workers, include_dashboard=False, **common)
    gpu = t.device == "cuda" or (t.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
    pool = t.rollout_pool_ranks if t.rollout_pool == "separate" else 0
    launch = Launch([args.recipe, *args.overrides], world, t.n_gpus_per_node, gpu,
                    args.cpus_per_rank, t.nnodes, args.pg_timeout, pool=pool,
                    max_restarts=t.rollout_pool_max_restarts)
    try:
        return launch.run()
    except (RuntimeError, ValueError, ray.exceptions.RayError) as e:  # before any rank ran
        launch.log(f"error: {_describe(e) if isinstance(e, ray.exceptions.RayError) else e}", err=True)
        return 1
    except KeyboardInterrupt:
        launch.log("interrupted: stopping the ranks", err=True)
        return 130
    finally:
        launch.stop()
        ray.shutdown()


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM: stop the ranks as for Ctrl-C


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGTERM, _terminate)
    # through the package, so Ray pickles the actor class by reference to engine.launch_ray
    from engine.launch_ray import main as _main
    sys.exit(_main())
