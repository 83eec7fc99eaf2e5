"""``sagellm generate``: one or more prompts through the torch engine."""

from __future__ import annotations

from sagellm_core import hookimpl
from sagellm_core.errors import ConfigError
from sagellm_core.types import Request


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """``text`` as token ids: through the model's chat template as one user
    message when ``chat`` and the tokenizer has a template, else as is."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(text))


def cmd_generate(args) -> int:
    from sagellm_core.cli import single_overrides
    from sagellm_core.drivers.engines import build_engine, sized_pool
    from sagellm_core.replay import session
    from sagellm_core.runtime import Runtime

    from .engine import SamplingParams, TorchEngine

    settings = session.load_settings(args.config, overrides=single_overrides(args))
    engine, _ = build_engine(settings)
    if not isinstance(engine, TorchEngine):
        raise ConfigError(
            f"{settings.path}: [engine] name = {settings.engine.name!r}; `sagellm generate` runs the torch engine"
        )
    core = engine.start(Runtime(sized_pool(settings, engine)))
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    requests = [
        Request(f"prompt-{i}", encode_prompt(core.tokenizer, text, not args.raw), args.max_tokens)
        for i, text in enumerate(args.prompt)
    ]
    results = core.generate(requests, lambda r: sampling)
    for request in requests:
        text = core.tokenizer.decode(results[request.request_id], skip_special_tokens=True)
        print(text if len(requests) == 1 else f"[{request.request_id}] {text}")
    return 0


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with the torch engine (a quick look at a model)")
    p.add_argument(
        "--config", required=True, help="a config whose [engine] is torch (contrib/configs/torch-smollm2.toml)"
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, not through the chat template")
    from sagellm_core.cli import add_set_option

    add_set_option(p)
    p.set_defaults(func=cmd_generate)
