"""engine/rollout/bridge.py between 3 plain processes' worth of ranks: two training ranks (this
process: rank 0 hosts the store and sends the requests, rank 1 sends the weights) and a pool
rank (a subprocess serving as engine/rollout/pool.py's `serve` does) that is SIGKILLed after it
answered one of the two relays of step 3. Its replacement reloads the weights re-sent from its
restart point and answers what the dead rank had not: every relay gets every step's result once,
in order, made with the weights of that step."""
import os
import pickle
import signal
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.rollout.bridge import PREFIX, StoreBridge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, KILL_AT, WORLD = 5, 3, 3
WEIGHT_BYTES = (5 << 20) + 3  # two store parts


def weights_of(version):
    return torch.arange(WEIGHT_BYTES, dtype=torch.int64).add_(version * 7).remainder_(251).to(torch.uint8)


def expected(step, version):
    return (step, version, int(weights_of(version)[::997].sum()) * step)


def pool_rank(port):
    """The pool rank (bridge rank 2): serve rank 0's requests in order, the weights from rank 1."""
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=30))
    bridge = StoreBridge(2, WORLD, 30, durable=True, store=store)
    version, weights = None, None
    while True:
        kind, msg = bridge.recv(0)
        if kind == "stop":
            bridge.flush()
            return
        if kind == "weights":
            size = bridge.recv(1)
            weights = torch.empty(size, dtype=torch.uint8)
            bridge.recv_tensor(weights, 1)
            assert bridge.recv(1) == ("end", None)
            version = msg
            continue
        result = (msg, version, int(weights[::997].sum()) * msg)
        bridge.send(result, 0)
        if msg == KILL_AT and bridge.incarnation == 0:  # one relay answered, the other not
            os.kill(os.getpid(), signal.SIGKILL)
        bridge.send(result, 1)


def _start(port):
    return subprocess.Popen([sys.executable, "-c", f"from tests.test_bridge import pool_rank; pool_rank({port})"],
                            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), cwd=ROOT)


def test_a_killed_pool_rank_is_replaced_and_nothing_is_lost_or_doubled():
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    trainer0 = StoreBridge(0, WORLD, 30, durable=False, store=store)
    trainer1 = StoreBridge(1, WORLD, 30, durable=False,
                           store=dist.TCPStore("127.0.0.1", store.port, None, is_master=False,
                                               timeout=timedelta(seconds=30)))
    procs = [_start(store.port)]
    got = {0: [], 1: []}

    def trainer1_side():  # the feeder of the pool rank's weights, and relay 1
        for step in range(1, STEPS + 1):
            w = weights_of(step - 1)
            trainer1.send(w.numel(), 2)
            trainer1.send_tensor(w, 2)
            trainer1.send(("end", None), 2)
            got[1].append(trainer1.recv(2))
        trainer1.flush()

    side = threading.Thread(target=trainer1_side)
    side.start()
    try:
        for step in range(1, STEPS + 1):
            trainer0.send(("weights", step - 1), 2)
            trainer0.send(("generate", step), 2)
            if step == KILL_AT:  # the pool rank dies answering it; a new process takes its place
                assert procs[0].wait(timeout=60) == -signal.SIGKILL
                procs.append(_start(store.port))
            got[0].append(trainer0.recv(2))
        trainer0.send(("stop", None), 2)
        trainer0.flush()
        side.join(timeout=60)
        assert procs[-1].wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    want = [expected(step, step - 1) for step in range(1, STEPS + 1)]
    assert got[0] == want and got[1] == want
    assert store.add(f"{PREFIX}incarnation/2", 0) == 2
    # what the replacement sent again is only what the relays lacked: nothing left unread
    assert not any(store.check([f"{PREFIX}m/2/{r}/{seq}"]) for r in (0, 1) for seq in range(STEPS + 1))
    # the pool rank kept only what it read since its last restart point (the weights of step 5)
    restart_read, _ = pickle.loads(store.get(f"{PREFIX}restart/2"))
    assert restart_read == [2 * (STEPS - 1), 3 * (STEPS - 1), 0]
    assert not store.check([f"{PREFIX}m/0/2/0"]) and not store.check([f"{PREFIX}m/1/2/1/1"])
    assert store.check([f"{PREFIX}m/0/2/{2 * (STEPS - 1)}"])
