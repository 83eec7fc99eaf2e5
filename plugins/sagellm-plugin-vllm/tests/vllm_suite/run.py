"""Run vLLM's own scheduler and prefix-caching tests twice: with vLLM's
classes, then with sagellm's substituted (``sagellm_substitute.py``), and
check that the substitution fails nothing that stock vLLM passes.

    python plugins/sagellm-plugin-vllm/tests/vllm_suite/run.py [--cache DIR]

vLLM's wheel has no tests; they come from its sdist on PyPI (pinned by
version and sha256), unpacked under ``--cache``. The tests build their
``ModelConfig`` from a hub model's ``config.json`` (no weights): a minimal
one for ``facebook/opt-125m`` is written to an offline HF cache there. Tests
whose model is not in that cache fail in both runs; they are listed with
vLLM's error, the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from sagellm_core.kit.testing import junit_results

VERSION = "0.33.0"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX = "https://pypi.org/simple/vllm/"
TESTS = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_prefix_caching.py")
HERE = Path(__file__).resolve().parent

#: The one hub model the two files mostly use, as much config as vLLM reads.
OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(cache: Path) -> Path:
    """The sdist's tests, unpacked under ``cache`` from an archive whose
    sha256 is checked every time, cached or downloaded: a cached archive
    that does not match is refused, and so is a folder unpacked earlier
    without its archive beside it."""
    root = cache / f"vllm-{VERSION}"
    archive = cache / f"vllm-{VERSION}.tar.gz"
    if archive.exists():
        digest = sha256_of(archive)
        if digest != SDIST_SHA256:
            sys.exit(f"run.py: cached {archive} has sha256 {digest}, expected {SDIST_SHA256}; delete it to fetch again")
        if (root / TESTS[0]).exists():
            return root
    elif (root / TESTS[0]).exists():
        sys.exit(f"run.py: {root} has no checked archive beside it ({archive.name}); delete it to fetch again")
    if not archive.exists():
        page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
        links = [h for h in re.findall(r'href="([^"]+)"', page) if f"/vllm-{VERSION}.tar.gz" in h]
        if not links:
            sys.exit(f"run.py: no vllm-{VERSION}.tar.gz on {INDEX}")
        data = urllib.request.urlopen(links[0].split("#")[0], timeout=300).read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SDIST_SHA256:
            sys.exit(f"run.py: vllm-{VERSION}.tar.gz has sha256 {digest}, expected {SDIST_SHA256}")
        archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"vllm-{VERSION}/tests/")]
        tar.extractall(cache, members=members, filter="data")
    return root


def offline_hub(cache: Path) -> Path:
    home = cache / "hf_home"
    repo = home / "hub" / "models--facebook--opt-125m"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return home


def run_suite(root: Path, hub: Path, substitute: bool, report: Path) -> tuple[int, dict[str, str]]:
    """Run the tests; return how many ran and {test id: first line of the
    failure} for the ones that failed or errored."""
    env = dict(os.environ, HF_HOME=str(hub), HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(root), env.get("PYTHONPATH")]))
    args = [sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider", "--noconftest"]
    args += ["-o", "addopts=", f"--junitxml={report}"]
    if substitute:
        args += ["-p", "sagellm_substitute"]
    subprocess.run(args, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return junit_results(
        report, name=lambda case: f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("VLLM_SUITE_CACHE", ".vllm-suite")))
    args = parser.parse_args()
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    root = fetch_sdist(cache)
    hub = offline_hub(cache)
    total_stock, stock = run_suite(root, hub, False, cache / "stock.xml")
    total, ours = run_suite(root, hub, True, cache / "sagellm.xml")
    print(f"vLLM {VERSION} tests: {', '.join(TESTS)}")
    print(f"  stock vLLM classes:   {total_stock - len(stock)} passed, {len(stock)} failed")
    print(f"  sagellm substituted:  {total - len(ours)} passed, {len(ours)} failed")
    print("Failing with stock vLLM too (the reason is vLLM's own error):")
    for name, reason in sorted(stock.items()):
        print(f"  {name}: {reason}")
    regressions = sorted(set(ours) - set(stock))
    if regressions or total != total_stock:
        print("FAILED with sagellm's classes only:")
        for name in regressions:
            print(f"  {name}: {ours[name]}")
        return 1
    print("No test fails with sagellm's classes that passes with vLLM's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
