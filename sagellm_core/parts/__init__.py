"""Self-contained parts the runtime uses, each behind a small interface a
reader of the kernel can take as given: the host tier's index (``tiers``),
the hook calls from cached plans (``dispatch``) and their timer
(``timing``), the counters a report is built from (``counters``), the
checks of plugins' answers (``answers``),
the whole-accounting check (``invariants``), the hook time limit and the
lifetime fallback's guard (``watchdog``), and the config sections the kernel
only carries (``sections``)."""
