"""What engine drivers share beyond the runtime's API: the engine-version
check and a live engine's runtime (``engines``), the continuous-batching
step packer (``stepping``), the observer of an engine's own cached blocks
(``blocks``) and the request-at-a-time loop of cache-only drivers
(``serial``)."""
