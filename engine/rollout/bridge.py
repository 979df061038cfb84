"""A bridge a rollout pool rank can be replaced behind (trainer.rollout_pool_max_restarts > 0):
the separate pool's messages (engine/rollout/pool.py, the `Bridge` interface: send / recv /
send_tensor / recv_tensor / flush / announce / announced) kept in the launch store, which
training rank 0 serves and which outlives any pool rank.

Channels: each (sender, receiver) pair is an ordered channel; its message `seq` lives at
`m/SRC/DST/SEQ` (in parts of at most 4 MB: the store takes 8 MB a value) until the receiver has
read it, and the receiver records how far it has read (`r/SRC/DST`). A send never waits for
the receiver; `flush` waits until every message sent was read.

Restart: a pool rank serves training rank 0's requests in order, each one fully before the
next (weights, generate, validate, stop). Its state is therefore the weights of the last
'weights' message plus the requests after it, so that message is its restart point: when a pool
rank reads one it records where every channel stands (`restart/RANK`: what it has read, what it
has sent) and drops the messages before; what it reads after is kept. Its replacement (the
same rank in a new process: `incarnation` counts them) starts from the restart point: it reads
the 'weights' message and its buckets again (the weights re-sent), loads them and serves the
requests after it again; of what it sends, a message its receiver already has (read, or
waiting in the store) is skipped, so each training rank gets each result once, and the
requests in flight to the dead rank (read, not answered) are answered by the replacement.

Not for partial rollouts (a sync is read ahead of the generation it pauses: the requests before
it are not done) nor for engines fed over an update group (an NCCL group a replacement cannot
rejoin): the config refuses those (engine/config/validate_pool.py).

Tests: tests/test_bridge.py, tests/test_launch_ray.py
"""
import pickle
import time

import torch

PREFIX = "trident-bridge-store/"
PART = 4 << 20  # bytes a store value holds at most here (the store's own limit is 8 MB)
ANNOUNCED = PREFIX + "weights-announced"


def is_restart_point(src, obj):
    """A pool rank's restart point: training rank 0's 'weights' message (engine/rollout/pool.py)."""
    return src == 0 and isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "weights"


class StoreBridge:
    """Messages between any two launched ranks through the launch store. `durable` (pool ranks):
    keep what was read since the restart point, and resume from it when this rank ran before."""

    def __init__(self, rank, world, timeout_s, durable, store=None, poll_s=0.005):
        if store is None:
            from parallel.mesh import launch_store
            store = launch_store(timeout_s)
        self.store, self.rank, self.world, self.durable = store, rank, world, durable
        self.timeout_s, self.poll_s, self.bytes = timeout_s, poll_s, 0
        self.sent, self.read = [0] * world, [0] * world
        self.parts = {}  # durable: (src, seq) -> parts of a message read and kept
        self.incarnation = store.add(f"{PREFIX}incarnation/{rank}", 1) - 1  # 0: the first process
        self.catching_up = set()  # receivers that may hold what an earlier incarnation sent
        if durable and self.incarnation:
            key = f"{PREFIX}restart/{rank}"
            if store.check([key]):  # else it died before its first restart point: from the start
                self.read, self.sent = pickle.loads(store.get(key))
            self.catching_up = set(range(world))
        self.kept = list(self.read)  # durable: the oldest message kept on each incoming channel

    @staticmethod
    def _key(src, dst, seq):
        return f"{PREFIX}m/{src}/{dst}/{seq}"

    # -- sending -----------------------------------------------------------------------------
    def send(self, obj, dst):
        self._put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dst)

    def send_tensor(self, tensor, dst):
        self._put(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), dst)

    def _put(self, data, dst):
        seq = self.sent[dst]
        self.sent[dst] += 1
        key = self._key(self.rank, dst, seq)
        if dst in self.catching_up:
            if self.store.check([key]) or seq < self._read_by(dst):
                return  # sent by the rank this one replaces: the receiver has it or will read it
            self.catching_up.discard(dst)  # from here on, new messages
        parts = [data[i:i + PART] for i in range(0, len(data), PART)] or [b""]
        for i in range(1, len(parts)):
            self.store.set(f"{key}/{i}", parts[i])
        # the head last: a message is there when its head is
        self.store.set(key, len(parts).to_bytes(8, "little") + parts[0])
        self.bytes += len(data)

    def _read_by(self, dst):
        key = f"{PREFIX}r/{self.rank}/{dst}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def flush(self):
        """Wait until every message sent has been read (bounded by the store's timeout). A pool
        rank's messages wait in the store, which training rank 0 keeps until the training ranks
        have read all they asked for (and which may be gone once they have): nothing to wait for."""
        if self.durable:
            return
        deadline = time.monotonic() + self.timeout_s
        for dst in range(self.world):
            while self.sent[dst] and self._read_by(dst) < self.sent[dst]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bridge rank {self.rank}: rank {dst} read {self._read_by(dst)} of "
                                       f"{self.sent[dst]} messages within {self.timeout_s} s")
                time.sleep(self.poll_s)

    def announce(self):
        """Count one more weight sync begun (training rank 0)."""
        self.store.add(ANNOUNCED, 1)

    def announced(self):
        return self.store.add(ANNOUNCED, 0)

    # -- receiving ---------------------------------------------------------------------------
    def recv(self, src):
        obj = pickle.loads(self._take(src))
        if self.durable and is_restart_point(src, obj):
            self._restart_point(src)
        return obj

    def recv_tensor(self, tensor, src):
        data = self._take(src)
        tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _take(self, src):
        seq = self.read[src]
        key = self._key(src, self.rank, seq)
        head = self.store.get(key)  # waits for it (up to the store's timeout)
        n = int.from_bytes(head[:8], "little")
        data = head[8:] + b"".join(self.store.get(f"{key}/{i}") for i in range(1, n))
        self.read[src] += 1
        self.store.set(f"{PREFIX}r/{src}/{self.rank}", str(self.read[src]))
        if self.durable:
            self.parts[(src, seq)] = n
        else:
            self._drop(src, seq, n)
        self.bytes += len(data)
        return data

    def _drop(self, src, seq, n):
        key = self._key(src, self.rank, seq)
        for i in range(1, n):
            self.store.delete_key(f"{key}/{i}")
        self.store.delete_key(key)

    def _restart_point(self, src):
        """Just read from `src` the message a replacement starts from: record where every
        channel stands, then drop what was read before it."""
        read = list(self.read)
        read[src] -= 1  # that message itself is read again
        self.store.set(f"{PREFIX}restart/{self.rank}", pickle.dumps((read, list(self.sent))))
        for s in range(self.world):
            for seq in range(self.kept[s], read[s]):
                n = self.parts.pop((s, seq), None)
                if n is not None:
                    self._drop(s, seq, n)
        self.kept = read
