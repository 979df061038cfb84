"""A separate rollout pool (`trainer.rollout_pool: separate`): the last `rollout_pool_ranks` of
the launched ranks generate, the others train; the two sets never share a device.

Worlds: the training ranks form their own torch.distributed world (Megatron sees only them);
the pool ranks form another (its rollout groups: engine/rollout/group.py); a `Bridge` — one gloo
process group over every launched rank, set up once — carries the rest:

* weights: after each update the training ranks materialise the full tensors bucket by bucket
  (parallel/reshard.py, collective over the training world, one bucket of extra memory) and
  training rank j sends each bucket to the pool ranks assigned to it (pool rank p <- training
  rank p mod T), which load it into their group's engine (SGLang groups: the hand-off inside
  the group as when colocated);
* requests: training rank 0 sends every pool rank the same ordered stream of requests
  (weights, generate step s, validate, stop); pool ranks serve them in order, so a request for
  step s+1 sent before step s trains is generated while it trains (one-step off-policy);
* results: each group leader sends each training DP replica's relay exactly the responses of
  that replica's prompts; the relay broadcasts them in its replica.

Every batch carries the weight version it was generated with (staleness = step - 1 - version).
"""
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


def pool_ranks(world, pool):
    """(training ranks, pool ranks) of the launched world."""
    return range(0, world - pool), range(world - pool, world)


class Bridge:
    """Point-to-point messages between any two launched ranks (gloo, CPU tensors). Sends do not
    wait for the receiver (two ranks may each be sending to the other: a trainer its next
    request, a pool rank its last results); messages between two ranks arrive in order."""

    def __init__(self, rank, world, timeout_s):
        from parallel.mesh import launch_store
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("trident-bridge/", launch_store(timeout_s)), rank, world,
                                        timedelta(seconds=timeout_s))
        self.rank, self.bytes = rank, 0
        self._pending = []  # (work, tensor): a send in flight keeps its buffer alive

    def send(self, obj, dst):
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.send_tensor(torch.tensor([data.numel()], dtype=torch.long), dst)
        self.send_tensor(data, dst)

    def recv(self, src):
        size = torch.empty(1, dtype=torch.long)
        self.recv_tensor(size, src)
        data = torch.empty(int(size), dtype=torch.uint8)
        self.recv_tensor(data, src)
        return pickle.loads(data.numpy().tobytes())

    def send_tensor(self, tensor, dst):
        tensor = tensor.contiguous()
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((self.pg.send([tensor], dst, 0), tensor))
        self.bytes += tensor.numel() * tensor.element_size()

    def flush(self):
        """Wait until every message sent has been received."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def recv_tensor(self, tensor, src):
        self.pg.recv([tensor], src, 0).wait()
        self.bytes += tensor.numel() * tensor.element_size()


def _flat(named):
    """One uint8 buffer of a bucket's tensors (one message instead of one per tensor)."""
    return torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for _, t in named])


def _unflat(buffer, manifest):
    out, at = [], 0
    for name, shape, dtype in manifest:
        n = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
        out.append((name, buffer[at:at + n].view(dtype).view(shape)))
        at += n
    return out


# --------------------------------------------------------------------------------------------
# Training side
# --------------------------------------------------------------------------------------------

class PoolClient:
    """The training ranks' end (every training rank holds one)."""

    def __init__(self, bridge, train_ranks, pool, replicas, leaders):
        """replicas: training ranks of each DP replica; leaders: bridge ranks of the pool's
        group leaders (each answers every relay, in this order)."""
        self.bridge, self.pool, self.replicas = bridge, list(pool), replicas
        self.leaders = list(leaders)
        self.T = len(train_ranks)
        self.rank = dist.get_rank()  # training-world rank == bridge rank (training ranks come first)
        self.version = -1  # the weights the pool holds (0: the initial ones)

    def send_weights(self, chunks, hf_config, bucket_megabytes, plan=None):
        """Collective over the training world: every bucket to every pool rank."""
        from engine.hybrid import _bucket_bytes, _to_hf
        from parallel.reshard import iter_buckets
        self.version += 1
        mine = [p for p in self.pool if p % self.T == self.rank]
        if self.rank == 0:
            for p in self.pool:
                self.bridge.send(("weights", self.version), p)
        sent = 0
        for bucket in iter_buckets(chunks, _bucket_bytes(bucket_megabytes), plan=plan):
            named = _to_hf(hf_config, bucket)
            if mine:
                buffer = _flat(named)
                manifest = [(n, tuple(t.shape), t.dtype) for n, t in named]
                for p in mine:
                    self.bridge.send(manifest, p)
                    self.bridge.send_tensor(buffer, p)
                sent += buffer.numel()
        for p in mine:  # the sender of a pool rank's buckets closes its stream
            self.bridge.send(("end", None), p)
        return sent

    def request(self, step, prompt_ids, keys, sampling, n_train):
        """Ask the pool for step `step`'s responses (training rank 0 only)."""
        if self.rank == 0:
            relays = [replica[0] for replica in self.replicas]
            for p in self.pool:
                self.bridge.send(("generate", dict(step=step, prompts=prompt_ids, keys=keys, sampling=sampling,
                                                    relays=relays, n_train=n_train)), p)

    def receive(self, dp_rank, replica_group):
        """This replica's {prompt index: (responses, log-probs, routed)} and the weight version
        they were generated with (collective within the replica)."""
        relay = self.replicas[dp_rank][0]
        box = [None]
        if self.rank == relay:
            got, version = {}, None
            for leader in self.leaders:
                part, version = self.bridge.recv(leader)
                got.update(part)
            box = [(got, version)]
        if replica_group is not None:
            dist.broadcast_object_list(box, src=relay, group=replica_group)
        return box[0]

    def validate(self, prompt_ids, sampling):
        """Greedy responses for the validation prompts (training rank 0 gets them all)."""
        if self.rank != 0:
            return None
        for p in self.pool:
            self.bridge.send(("validate", dict(prompts=prompt_ids, sampling=sampling)), p)
        out = {}
        for leader in self.leaders:
            out.update(self.bridge.recv(leader))
        return [out[i] for i in range(len(prompt_ids))]

    def stop(self):
        if self.rank == 0:
            for p in self.pool:
                self.bridge.send(("stop", None), p)
        self.bridge.flush()


# --------------------------------------------------------------------------------------------
# Pool side
# --------------------------------------------------------------------------------------------

def serve(bridge, group, T, generate):
    """The pool rank's loop: serve training rank 0's requests in order until 'stop'.

    group: this rank's engine.rollout.group.GroupedRollout over the pool world;
    generate(engine, prompt_ids, sampling, keys) runs the engine."""
    from engine.rollout.topology import overlap, split_evenly
    source = bridge.rank % T  # the training rank that sends this pool rank its weights
    version = -1
    while True:
        kind, msg = bridge.recv(0)
        if kind == "stop":
            bridge.flush()
            return
        if kind == "weights":
            version = msg
            group.begin_sync()
            while True:
                head = bridge.recv(source)  # a bucket's manifest, or the end of the stream
                if isinstance(head, tuple) and head and head[0] == "end":
                    break
                buffer = torch.empty(sum(torch.empty((), dtype=d).element_size() * int(torch.Size(s).numel())
                                         for _, s, d in head), dtype=torch.uint8)
                bridge.recv_tensor(buffer, source)
                group.load_bucket(_unflat(buffer, head))
            group.finish_sync()
            continue
        if kind == "validate":
            mine, out = group.generate_split(msg["prompts"], list(range(len(msg["prompts"]))),
                                             msg["sampling"], generate=generate)
            if group.is_leader:  # every leader answers, with nothing if its share was empty
                bridge.send({} if out is None else {i: out.responses[k] for k, i in enumerate(mine)}, 0)
            continue
        # generate: this group's share, then each training replica's part to its relay
        mine, out = group.generate_split(msg["prompts"], msg["keys"], msg["sampling"], generate=generate)
        n = msg["sampling"].n
        if not group.is_leader:
            continue
        produced = {} if out is None else {
            i: (out.responses[k * n:(k + 1) * n], out.log_probs[k * n:(k + 1) * n],
                None if out.routed_experts is None else out.routed_experts[k * n:(k + 1) * n])
            for k, i in enumerate(mine)}
        shares = split_evenly(len(msg["prompts"]), len(msg["relays"]))
        for relay, share in zip(msg["relays"], shares):
            part = overlap(range(mine[0], mine[-1] + 1), share) if mine else range(0)
            bridge.send(({i: produced[i] for i in part}, version), relay)
