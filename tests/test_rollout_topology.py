"""Rollout topology (engine/rollout/topology.py): groups, leaders, GPU placement, routing."""
import pytest

from engine.rollout.topology import (TopologyError, replicas_of, rollout_topology, route_plan,
                                     split_evenly)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_one_node_of_eight(tp):
    topo = rollout_topology(8, 8, tp)
    assert len(topo.groups) == 8 // tp
    for i, g in enumerate(topo.groups):
        assert g.ranks == tuple(range(i * tp, (i + 1) * tp))
        assert g.leader == i * tp and g.base_gpu_id == i * tp and g.nnodes == 1
        assert g.node_leaders == (g.leader,)
        assert topo.engine_fields(g.leader) == {"tp_size": tp, "base_gpu_id": i * tp}
    builders = [r for r in range(8) if topo.builds_engine(r)]
    assert builders == [g.leader for g in topo.groups]
    if tp > 1:  # members hold no engine
        with pytest.raises(ValueError, match="builds no rollout engine"):
            topo.engine_fields(1)


def test_engines_on_the_second_node_count_gpus_from_zero():
    topo = rollout_topology(16, 8, 4)
    assert [(g.leader, g.base_gpu_id) for g in topo.groups] == [(0, 0), (4, 4), (8, 0), (12, 4)]


def test_an_engine_over_two_nodes():
    topo = rollout_topology(16, 8, 16)
    (g,) = topo.groups
    assert g.nnodes == 2 and g.node_leaders == (0, 8)
    assert [r for r in range(16) if topo.builds_engine(r)] == [0, 8]
    assert topo.engine_fields(0, "10.0.0.1:5000") == {"tp_size": 16, "base_gpu_id": 0, "nnodes": 2,
                                                      "node_rank": 0, "dist_init_addr": "10.0.0.1:5000"}
    assert topo.engine_fields(8, "10.0.0.1:5000")["node_rank"] == 1
    assert topo.engine_fields(8, "10.0.0.1:5000")["base_gpu_id"] == 0
    with pytest.raises(ValueError, match="dist_init_addr"):
        topo.engine_fields(0)


def test_deepseek_v3_at_256_gpus_is_16_engines_of_16_gpus_over_2_nodes():
    s = rollout_topology(256, 8, 16).summary()
    assert (s["engines"], s["gpus_per_engine"], s["nodes_per_engine"]) == (16, 16, 2)


@pytest.mark.parametrize("world,node,tp,heads,message", [
    (8, 8, 3, None, "does not divide the world size 8; use one of 1, 2, 4, 8"),
    (12, 6, 4, None, "does not divide the 6 GPUs of a node"),
    (24, 8, 12, None, "must be a multiple of 8"),
    (8, 8, 8, 28, "does not divide the model's 28 attention heads"),
    (8, 8, 0, None, "must be a positive integer"),
])
def test_bad_combinations_are_refused(world, node, tp, heads, message):
    with pytest.raises(TopologyError, match="actor_rollout_ref.rollout.tensor_model_parallel_size") as e:
        rollout_topology(world, node, tp, num_attention_heads=heads)
    assert message in str(e.value)


def test_config_refuses_a_bad_rollout_tp_with_the_key():
    import os

    from engine.config import ConfigError, derive, load_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "recipes", "tiny_cpu_demo.yaml"),
                      ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match="rollout.tensor_model_parallel_size=3 does not divide"):
        derive(cfg, 4, dataset_len=1024)
    cfg = load_config(os.path.join(root, "recipes", "tiny_cpu_demo.yaml"),
                      ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert derive(cfg, 4, dataset_len=1024).rollout_topology.summary()["engines"] == 2


def test_routes_cover_every_prompt_once():
    for prompts, groups, dp in [(8, 2, 4), (8, 4, 2), (12, 3, 4), (10, 4, 2), (6, 6, 1)]:
        plan = route_plan(prompts, groups, dp)
        sent = sorted(i for g in range(groups) for _, r in plan.sends(g) for i in r)
        assert sent == list(range(prompts))
        for d in range(dp):
            got = [i for _, r in plan.receives(d) for i in r]
            assert got == list(plan.train[d]) == list(range(d * prompts // dp, (d + 1) * prompts // dp))
    assert [len(r) for r in split_evenly(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="do not split over 4"):
        route_plan(6, 2, 4)


def test_replicas_from_dp_ranks():
    # TP 2 x DP 2 (Megatron puts TP neighbours next to each other)
    assert replicas_of([0, 0, 1, 1]) == ((0, 1), (2, 3))
    assert replicas_of([0, 1, 0, 1]) == ((0, 2), (1, 3))


def test_plan_prints_and_writes_the_rollout_layout(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "plan.py"),
                           os.path.join(root, "recipes", "deepseek_v3_671b_grpo.yaml"), "--gpus", "256",
                           "--gpu-mem", "141", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rollout: 16 sglang engine(s) x 16 GPU(s) (TP 16), 2 node(s) per engine" in proc.stdout
    rollout = json.loads(out.read_text())["rollout"]
    assert (rollout["engines"], rollout["gpus_per_engine"], rollout["nodes_per_engine"]) == (16, 16, 2)
    # 671B bf16 parameters over 16 GPUs, the KV cache in the rest of SGLang's share
    assert 75 < rollout["weights_per_gpu"] < 80 and rollout["kv_cache_per_gpu"] > 0


def test_node_address_is_the_interface_the_other_nodes_reach():
    """Where a multi-node engine's and a weight-update group's peers meet: the interface routing
    to MASTER_ADDR (a hostname's /etc/hosts entry is often loopback, unreachable from elsewhere)."""
    import socket

    import psutil

    from parallel.mesh import node_address
    assert node_address({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "127.0.0.1"
    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not own:
        pytest.skip("this machine has no IPv4 interface besides loopback")
    for address in own:  # rank 0 on this node at that address: reached through it
        assert node_address({"MASTER_ADDR": address, "MASTER_PORT": "29500"}) == address
    # a rendezvous host elsewhere on the first interface's network: the same interface
    network = own[0].rsplit(".", 1)[0]
    peer = next(f"{network}.{n}" for n in (1, 2, 3) if f"{network}.{n}" not in own)
    assert node_address({"MASTER_ADDR": peer}) in own
    with socket.socket() as s:  # and peers can meet there: it is bound on this node
        s.bind((node_address({"MASTER_ADDR": peer}), 0))
