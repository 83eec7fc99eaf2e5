"""An outside team's view: install the example plugin from its own folder
into a fresh virtual environment, beside the core, and select it by config."""

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_example_plugin_installs_into_a_fresh_environment(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, str(PROJECT), str(PROJECT / "contrib" / "example-plugin")], check=True)
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean_env["COLUMNS"] = "200"

    def sagellm(*args):
        return subprocess.run(
            [str(bin_dir / "sagellm"), *args], capture_output=True, text=True, env=clean_env, cwd=tmp_path
        )

    listing = sagellm("plugins")
    assert listing.returncode == 0, listing.stderr
    assert "fifo" in listing.stdout and "sagellm-example-fifo" in listing.stdout
    # Only the core and the example are installed: the radix cache is not.
    config = PROJECT / "contrib" / "configs" / "example-fifo.toml"
    missing = sagellm("config", "check", str(config))
    assert missing.returncode == 2
    assert (
        "unknown prefix_cache plugin 'radix'; installed: none (first-party prefix_cache plugins: pip install sagellm-plugin-prefix-cache)"
        in missing.stderr
    )
    subprocess.run(
        [
            *pip,
            str(PROJECT / "plugins" / "sagellm-plugin-prefix-cache"),
            str(PROJECT / "plugins" / "sagellm-plugin-kv-pool"),
        ],
        check=True,
    )
    out = tmp_path / "r.json"
    run = sagellm("replay", "--config", str(config), "--json", str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["plugins"]["eviction"] == "fifo"
    assert report["evicted_blocks"] > 0 and report["requests"] == 4 * 8 * 4
