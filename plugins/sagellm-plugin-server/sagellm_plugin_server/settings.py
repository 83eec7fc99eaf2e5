"""The ``[server]`` config section, which this distribution declares
(``sagellm.sections``) and ``sagellm serve`` reads. Its values are checked
by the type of each field's default, then here."""

from __future__ import annotations

from attrs import frozen


@frozen
class ServerSettings:
    #: Requests allowed to wait for admission; one more is answered 429.
    max_waiting: int = 256
    #: The model name clients send; empty: the engine's model setting.
    model_name: str = ""
    #: KV blocks each tenant may hold pinned through ``kv_hints.pin`` (0: no pins).
    pin_budget_blocks: int = 64

    def __attrs_post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting = {self.max_waiting!r}: a positive integer")
        if self.pin_budget_blocks < 0:
            raise ValueError(f"pin_budget_blocks = {self.pin_budget_blocks!r}: 0 or more")
