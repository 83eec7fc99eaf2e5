"""Self-contained parts the runtime uses, each behind a small interface a
reader of the kernel can take as given: the host tier's index (``tiers``)
and the hook timer (``timing``, a pluggy wrapper plugin)."""
