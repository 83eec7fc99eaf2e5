"""What engines share beyond the runtime's API: the engine protocol and the
step loop of the engines whose blocks the runtime owns (``step_engine``),
the step scheduler that packs each step (``step_scheduler``), a workload
fed to a step engine as it arrives (``arrivals``), the request-at-a-time
loop of cache-only drivers (``serial``), what a run records (``recorder``),
the engine plugins' contract and the check of an adapted engine's version
(``engines``), and the observer of an engine's own cached blocks
(``blocks``)."""
