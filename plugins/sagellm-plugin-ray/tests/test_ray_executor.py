"""Replays as Ray tasks, on a Ray started on this machine for each call."""

import json

import pytest

ray = pytest.importorskip("ray")

from sagellm_core.cli import main  # noqa: E402

CONFIG = (
    '[engine]\nmode = "cache-only"\n[prefix_cache]\nplugin = "radix"\n'
    '[kv_pool]\nplugin = "paged"\nnum_blocks = 100\n[eviction]\nplugin = "{policy}"\n'
)


def figures(path):
    return [
        (r["label"], r.get("sweep", {}).get("value"), r["block_hit_rate"], r["evicted_blocks"], r["ttft_s"])
        for r in json.loads(path.read_text())
    ]


def test_sweep_as_ray_tasks_gives_the_figures_of_one_process(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.format(policy="lru"))
    sweep = ["sweep", "--config", str(config), "--set", "kv_pool.num_blocks=150,400,900", "--max-requests", "60"]
    here, on_ray = tmp_path / "here.json", tmp_path / "ray.json"
    assert main([*sweep, "--quiet", "--json", str(here)]) == 0
    assert main([*sweep, "--quiet", "--json", str(on_ray), "--executor", "ray", "--workers", "2"]) == 0
    assert figures(on_ray) == figures(here)
    assert [value for _, value, *_ in figures(on_ray)] == [150, 400, 900]  # in the order asked, each its own run
    assert figures(here)[0][2] < figures(here)[2][2]
    assert not ray.is_initialized()  # the Ray it started is stopped


def test_compare_on_a_running_ray_leaves_it_running(tmp_path):
    lru, lfu = tmp_path / "lru.toml", tmp_path / "lfu.toml"
    lru.write_text(CONFIG.format(policy="lru"))
    lfu.write_text(CONFIG.format(policy="lfu"))
    compare = ["compare", "--config", str(lru), "--config", str(lfu), "--max-requests", "60", "--quiet"]
    here, on_ray = tmp_path / "here.json", tmp_path / "ray.json"
    assert main([*compare, "--json", str(here)]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main([*compare, "--json", str(on_ray), "--executor", "ray", "--workers", "1"]) == 0
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    assert figures(on_ray) == figures(here)
    assert [label for label, *_ in figures(on_ray)] == ["lru", "lfu"]


def test_a_run_that_fails_on_ray_is_its_own_one_line_error(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [1, 2]})
    trace.write_text(good + "\n" + "{not json\n")
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.format(policy="lru"))
    args = ["compare", "--config", str(config), "--config", str(config), "--trace", str(trace), "--quiet"]
    assert main([*args, "--executor", "ray", "--workers", "2"]) == 2
    ray_error = capsys.readouterr().err.strip()
    assert main(args) == 2
    local_error = capsys.readouterr().err.strip()
    assert ray_error == local_error
    assert len(ray_error.splitlines()) == 1 and "t.jsonl" in ray_error
    assert not ray.is_initialized()


def test_joins_the_cluster_that_ray_address_names(tmp_path, monkeypatch):
    """Two Ray nodes (raylets) on this machine, one CPU each, as two
    machines would be: the executor joins their cluster instead of
    starting a Ray of its own, the figures are one process's, and the
    cluster is left running."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        config = tmp_path / "c.toml"
        config.write_text(CONFIG.format(policy="lru"))
        sweep = ["sweep", "--config", str(config), "--set", "kv_pool.num_blocks=150,900", "--max-requests", "60"]
        here, on_ray = tmp_path / "here.json", tmp_path / "ray.json"
        assert main([*sweep, "--quiet", "--json", str(here)]) == 0
        assert main([*sweep, "--quiet", "--json", str(on_ray), "--executor", "ray", "--workers", "2"]) == 0
        assert figures(on_ray) == figures(here)
        ray.init(address=cluster.address)
        try:
            assert len([node for node in ray.nodes() if node["Alive"]]) == 2  # still up: the executor only joined
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
