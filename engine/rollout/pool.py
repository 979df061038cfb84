"""A separate rollout pool (`trainer.rollout_pool: separate`): the last `rollout_pool_ranks` of
the launched ranks generate, the others train; the two sets never share a device.

Worlds: the training ranks form their own torch.distributed world (Megatron sees only them);
the pool ranks form another (its rollout groups: engine/rollout/group.py); a `Bridge` — one gloo
process group over every launched rank, set up once — carries the rest:

* weights: after each update the training ranks materialise the full tensors bucket by bucket
  (parallel/reshard.py, collective over the training world, one bucket of extra memory). A
  backend with WEIGHTS_FROM_DISTRIBUTED (SGLang) gets them straight from the training rank that
  feeds its engine, over the weight-update group set up once at start (NCCL on GPU:
  engine/rollout/update_group.py); the bridge carries only each bucket's manifest to the
  engine's leader. Other backends (CPU) get each bucket over the bridge: training rank j sends
  it to the pool ranks it feeds, which load it into their group's engine;
* requests: training rank 0 sends every pool rank the same ordered stream of requests
  (weights, generate step s, stream groups: engine/rollout/streaming.py, validate, stop);
  pool ranks serve them in order, so the requests
  for steps s+1 .. s+k sent before step s trains are generated while it trains (k-step
  off-policy, trainer.off_policy_steps);
* results: each group leader sends each training DP replica's relay exactly the responses of
  that replica's prompts; the relay broadcasts them in its replica.

Every batch carries the weight version it was generated with (staleness = step - 1 - version),
and every response token that version (`rollout_versions`: engine/experience/staleness.py).
With trainer.partial_rollout a sync announced while a pool rank generates (training rank 0 counts
syncs in the launch store: `Bridge.announce`) pauses the generation at a token boundary; the rank
reads the requests ahead up to the 'weights' message, loads the weights and continues from the
tokens it has (engine/rollout/partial.py), each token stamped with its own version.
The buckets are cut and renamed as for a colocated engine (engine/rollout/colocated.py:
`bucket_bytes`, `to_hf_names`).

Tests: tests/test_rollout_pool.py, tests/test_streaming.py
"""
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


ANNOUNCED = "trident-bridge-weights-announced"  # the store's count of weight syncs begun


def pool_ranks(world, pool):
    """(training ranks, pool ranks) of the launched world."""
    return range(0, world - pool), range(world - pool, world)


class Bridge:
    """Point-to-point messages between any two launched ranks (gloo, CPU tensors). Sends do not
    wait for the receiver (two ranks may each be sending to the other: a trainer its next
    request, a pool rank its last results); messages between two ranks arrive in order."""

    def __init__(self, rank, world, timeout_s):
        from parallel.mesh import launch_store
        self.store = launch_store(timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("trident-bridge/", self.store), rank, world,
                                        timedelta(seconds=timeout_s))
        self.rank, self.world, self.bytes = rank, world, 0
        self._pending = []  # (work, tensor): a send in flight keeps its buffer alive

    def send(self, obj, dst):
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.send_tensor(torch.tensor([data.numel()], dtype=torch.long), dst)
        self.send_tensor(data, dst)

    def announce(self):
        """Count one more weight sync begun (training rank 0, before its 'weights' messages)."""
        self.store.add(ANNOUNCED, 1)

    def announced(self):
        """Weight syncs begun so far (never waits: a gloo receive cannot be polled, it completes
        only in wait(); the store's counter can)."""
        return self.store.add(ANNOUNCED, 0)

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


def _stamped(out, rows, version):
    """RolloutOutput.share of `rows`, every token stamped with its policy version: the weights'
    `version`, or each token's own (`out.versions`, a partial rollout's)."""
    from engine.rollout.batches import with_versions
    versions = getattr(out, "versions", None)
    return with_versions(out.share(rows), versions[rows] if versions is not None else
                         [[version] * len(r) for r in out.responses[rows]])


def buckets(chunks, size, plan, hf_config):
    """The full tensors to send, bucket by bucket (collective over the training world): a LoRA
    actor's base weights merged with its adapters (`plan` a lora.MergePlan), as the colocated
    sync sends them (engine/rollout/colocated.py)."""
    from engine.models import lora
    from parallel.reshard import iter_buckets
    if isinstance(plan, lora.MergePlan):
        return lora.merged_buckets(chunks, size, plan, hf_config)
    return iter_buckets(chunks, size, plan=plan)


def _is_end(message):
    return isinstance(message, tuple) and len(message) == 2 and message[0] == "end"


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

    def __init__(self, bridge, train_ranks, pool, replicas, leaders, tps=None, device="cpu", timeout_s=600):
        """replicas: training ranks of each DP replica; leaders: bridge ranks of the pool's
        group leaders (each answers every relay, in this order); tps: their engines' TP sizes
        when the backend takes weights from distributed (else None); device: the training one."""
        from engine.rollout.update_group import feeder
        self.bridge, self.pool, self.replicas = bridge, list(pool), replicas
        self.leaders = list(leaders)
        self.T = len(train_ranks)
        self.rank = dist.get_rank()  # training-world rank == bridge rank (training ranks come first)
        self.version = -1  # the weights the pool holds (0: the initial ones)
        self.update_group = self.pg = None
        if tps is not None:  # the engines this rank feeds join its group: once, now
            self._open_update_group(tps, device, timeout_s)
            self.fed = [leader for leader, _ in self.update_group.engines] if self.update_group else []
        else:
            self.fed = [p for i, p in enumerate(self.pool) if feeder(i, len(self.pool), self.T) == self.rank]

    def _open_update_group(self, tps, device, timeout_s):
        from engine.rollout.update_group import backend_for, open_as_sender, sender_address, update_groups
        mine = [g for g in update_groups(self.leaders, tps, self.T) if g.sender == self.rank]
        if not mine:
            return
        group, (address, port) = mine[0], sender_address()
        backend = backend_for(torch.device(device))
        for leader, offset in group.engines:
            self.bridge.send(("update_group", dict(master_address=address, master_port=port, rank_offset=offset,
                                                   world_size=group.world_size, group_name=group.name,
                                                   backend=backend)), leader)
        self.pg = open_as_sender(address, port, group.world_size, group.name, backend, timeout_s)
        self.update_group = group

    def send_weights(self, chunks, hf_config, bucket_megabytes, plan=None, version=None):
        """Collective over the training world: every bucket to every pool rank. `version`: the
        policy version of these weights (the updates they hold; default: one more than the last
        sent); every token generated with them is stamped with it."""
        from engine.rollout.colocated import bucket_bytes, to_hf_names
        from parallel import fsdp
        from engine.rollout.update_group import broadcast_bucket, manifest
        self.version = self.version + 1 if version is None else version
        if self.rank == 0:
            self.bridge.announce()  # a partial rollout in flight pauses for these (serve)
            for p in self.pool:
                self.bridge.send(("weights", self.version), p)
        sent = 0
        with fsdp.gathered(chunks):  # a fully sharded model's full values (parallel/fsdp.py)
            for bucket in buckets(chunks, bucket_bytes(bucket_megabytes), plan, hf_config):
                named = to_hf_names(hf_config, bucket)
                if self.pg is not None:  # the manifest to the leaders, the tensors over the group
                    described = manifest(named)
                    for p in self.fed:
                        self.bridge.send(described, p)
                    sent += broadcast_bucket(self.pg, named)
                elif self.fed:
                    buffer = _flat(named)
                    head = [(n, tuple(t.shape), t.dtype) for n, t in named]
                    for p in self.fed:
                        self.bridge.send(head, p)
                        self.bridge.send_tensor(buffer, p)
                    sent += buffer.numel()
        for p in self.fed:  # the sender of a pool rank's buckets closes its stream
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
        """This replica's {prompt index: RolloutOutput.share} and the weight version
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
        """The validation prompts' responses, `sampling.n` per prompt in prompt order (a list of
        lists; training rank 0 gets them all, the other ranks None)."""
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
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None


# --------------------------------------------------------------------------------------------
# Pool side
# --------------------------------------------------------------------------------------------

def serve(bridge, group, T, generate, partial=False):
    """The pool rank's loop: serve training rank 0's requests in order until 'stop'.

    group: this rank's engine.rollout.group.GroupedRollout over the pool world;
    generate(engine, prompt_ids, sampling, keys) runs the engine. partial
    (trainer.partial_rollout, engines with continue_generation: engine/rollout/partial.py): new
    weights announced while a generation runs pause it at a token boundary, are loaded, and the
    generation goes on from the tokens it has; each token is stamped with its own version."""
    from engine.rollout.topology import overlap, split_evenly
    from engine.rollout.update_group import feeder
    direct = group.backend.WEIGHTS_FROM_DISTRIBUTED
    if direct:  # the training rank feeding this engine; its leader joins that rank's group
        source = feeder(group.group.index, len(group.topology.groups), T)
        if group.is_leader:
            kind, params = bridge.recv(source)
            assert kind == "update_group", kind
            group.engine.join_update_group(**params)
    else:  # the training rank sending this pool rank its buckets
        source = feeder(bridge.rank - T, bridge.world - T, T)
    version, taken = -1, 0  # the weights loaded, and how many syncs so far
    inbox = []  # requests read ahead of their turn (partial rollouts look for new weights)

    def take_weights(msg):
        nonlocal version, taken
        version, taken = msg, taken + 1
        if direct:
            if group.is_leader:  # only the manifests come here; the tensors come over the group
                group.begin_sync()
                while not _is_end(head := bridge.recv(source)):
                    group.engine.update_weights_from_distributed(head)
                group.finish_sync()
            return
        group.begin_sync()
        while True:
            head = bridge.recv(source)  # a bucket's manifest, or the end of the stream
            if _is_end(head):
                break
            buffer = torch.empty(sum(torch.empty((), dtype=d).element_size() * int(torch.Size(s).numel())
                                     for _, s, d in head), dtype=torch.uint8)
            bridge.recv_tensor(buffer, source)
            group.load_bucket(_unflat(buffer, head))
        group.finish_sync()

    def weights_waiting():
        # a sync announced and not taken: read the requests ahead up to its 'weights' message
        # (its buckets follow it: left to take_weights)
        if not any(kind == "weights" for kind, _ in inbox) and bridge.announced() > taken:
            while not inbox or inbox[-1][0] != "weights":
                inbox.append(bridge.recv(0))
        return any(kind == "weights" for kind, _ in inbox)

    def run_partial(engine, prompt_ids, sampling, keys):
        from engine.rollout.partial import paused_rows, stamp
        from parallel.cpu import suspended
        with suspended():  # the engine runs no Megatron code (engine_generate's reason)
            out = engine.generate(prompt_ids, sampling, keys=keys, should_pause=weights_waiting)
        versions = stamp(None, out, version)
        while paused_rows(out):
            at = next(i for i, (kind, _) in enumerate(inbox) if kind == "weights")
            take_weights(inbox.pop(at)[1])
            with suspended():
                out = engine.continue_generation(prompt_ids, sampling, keys, out, should_pause=weights_waiting)
            versions = stamp(versions, out, version)
        out.versions = versions
        return out

    while True:
        kind, msg = inbox.pop(0) if inbox else bridge.recv(0)
        if kind == "stop":
            bridge.flush()
            return
        if kind == "weights":
            take_weights(msg)
            continue
        if kind == "stream":  # groups sent as their chunk is done (engine/rollout/streaming.py)
            from engine.rollout.streaming import serve_stream
            serve_stream(bridge, group, msg, run_partial if partial else generate, lambda: version)
            continue
        if kind == "validate":
            mine, out = group.generate_split(msg["prompts"], list(range(len(msg["prompts"]))),
                                             msg["sampling"], generate=generate)
            if group.is_leader:  # every leader answers, with nothing if its share was empty
                n = msg["sampling"].n  # the engine returns n responses per prompt, prompt-major
                bridge.send({} if out is None else {i: out.responses[k * n:(k + 1) * n] for k, i in enumerate(mine)}, 0)
            continue
        # generate: this group's share, then each training replica's part to its relay
        mine, out = group.generate_split(msg["prompts"], msg["keys"], msg["sampling"],
                                         generate=run_partial if partial else generate)
        n = msg["sampling"].n
        if not group.is_leader:
            continue
        produced = {} if out is None else {i: _stamped(out, slice(k * n, (k + 1) * n), version)
                                           for k, i in enumerate(mine)}
        shares = split_evenly(len(msg["prompts"]), len(msg["relays"]))
        for relay, share in zip(msg["relays"], shares):
            part = overlap(range(mine[0], mine[-1] + 1), share) if mine else range(0)
            bridge.send(({i: produced[i] for i in part}, version), relay)
