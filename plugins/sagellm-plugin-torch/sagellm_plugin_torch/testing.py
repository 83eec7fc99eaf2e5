"""For tests and benchmarks of the torch engine and of device plugins
(``sagellm-plugin-torch-npu``): multi-turn chat prompts, configs, engines,
and transformers' own generate as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from sagellm_core import config as config_mod
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request
from sagellm_plugin_torch.engine import EngineCore, TorchSettings

SYSTEM_PROMPTS = [
    "You are a helpful assistant who answers questions about geography. Keep answers short and factual.",
    "You are a careful Python tutor. Explain code step by step, and show a short example when it helps.",
    "You are a friendly cooking assistant. Suggest simple recipes with common ingredients and clear steps.",
    "You are an astronomy guide for curious children. Use simple words and one vivid comparison per answer.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name a river in Egypt.",
    "How tall is Mount Everest?",
    "What does a for loop do?",
    "How do I reverse a list?",
    "What is a dictionary?",
    "How do I boil an egg?",
    "What goes well with rice?",
    "How long do I bake bread?",
    "Why is the sky blue?",
    "What is a black hole?",
    "How far away is the Moon?",
]
FOLLOW_UPS = ["Tell me more.", "Can you give an example?", "Why is that?", "Summarise that in one line."]
EARLIER_REPLY = "Here is a short answer to your question, with the key facts first."


def chat_prompts(tokenizer, count: int = 32) -> list[list[int]]:
    """``count`` multi-turn chats: four shared system prompts, each chat one
    or two turns deep (an earlier question and reply, then a follow-up)."""
    prompts = []
    for i in range(count):
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]}]
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        if i % 3:
            messages.append({"role": "assistant", "content": EARLIER_REPLY})
            messages.append({"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def write_config(
    folder: Path,
    *,
    model: str = "smollm2",
    num_blocks: int = 512,
    block_size: int = 16,
    prefix_cache: bool = True,
    offload: bool = False,
    host_blocks: int = 1024,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    eviction: str = "lru",
    extra: str = "",
) -> Path:
    # Without a plugin, [prefix_cache] only sets the block size: no caching.
    cache = f"[prefix_cache]\nblock_size = {block_size}\n" + ('plugin = "radix"\n' if prefix_cache else "")
    stores = f'[kv_stores]\ntiers = ["host"]\n[kv_stores.host]\ncapacity_blocks = {host_blocks}\n' if offload else ""
    text = f"""
[engine]
name = "torch"
model = "{model}"
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = {max_num_batched_tokens}

{cache}
[kv_pool]
plugin = "paged"
num_blocks = {num_blocks}

[eviction]
plugin = "{eviction}"

[scheduler]
passes = ["fcfs"]

{stores}
{extra}
"""
    path = folder / f"torch-{num_blocks}-{int(prefix_cache)}-{int(offload)}-{max_num_seqs}.toml"
    path.write_text(text)
    return path


def engine_core(path: Path, **settings) -> EngineCore:
    loaded = config_mod.load(path)
    params = {k: v for k, v in loaded.engine.params.items() if k in attrs_fields()}
    return EngineCore(Runtime(loaded), TorchSettings(**{**params, **settings}))


def attrs_fields() -> set[str]:
    import attrs

    return {f.name for f in attrs.fields(TorchSettings)}


def requests(prompts: list[list[int]], max_tokens: int, prefix: str = "r") -> list[Request]:
    return [Request(f"{prefix}{i}", p, max_tokens) for i, p in enumerate(prompts)]


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_tokens: int, **options) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding),
    stopping at end-of-sequence as the engine does; ``options`` go to
    ``generate`` (``repetition_penalty``, ``logits_processor``)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        result = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
            **options,
        )
        out.append(result[0, len(prompt) :].tolist())
    return out


def save_tiny_llama(folder: Path, hidden_size: int = 32, num_heads: int = 4, num_kv_heads: int = 2) -> Path:
    """A tiny random Llama checkpoint folder: :func:`save_tiny_model`."""
    return save_tiny_model(folder, "llama", hidden_size, num_heads, num_kv_heads)


def save_tiny_model(
    folder: Path,
    model_type: str = "llama",
    hidden_size: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    tokenizer=None,
) -> Path:
    """Save a tiny random-weight model of ``model_type`` (llama, mistral,
    qwen2, qwen3; seeded) with a word-level tokenizer (``w0`` .. ``w127``)
    and a chat template, or with ``tokenizer`` (a transformers tokenizer,
    its vocabulary the model's), as a Hugging Face checkpoint folder; return it."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    extra = {"sliding_window": None} if model_type in ("mistral", "qwen2", "qwen3") else {}
    if model_type == "qwen3":
        extra["head_dim"] = hidden_size // num_heads
    config = AutoConfig.for_model(
        model_type,
        vocab_size=128 if tokenizer is None else len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        eos_token_id=127 if tokenizer is None else tokenizer.eos_token_id,
        bos_token_id=1 if tokenizer is None else tokenizer.bos_token_id,
        **extra,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        return folder
    raw = Tokenizer(tokenizer_models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="w127", unk_token="w0")
    # A chat template of words the vocabulary has: w2 opens a user turn, w3
    # an assistant turn, w4 asks for the answer.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ 'w2' if m['role'] == 'user' else 'w3' }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}"
    )
    tokenizer.save_pretrained(folder)
    return folder
