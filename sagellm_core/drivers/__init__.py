"""What engine drivers share beyond the runtime's API: the engine-version
check and a live engine's runtime (``engines``), and the continuous-batching
step packer (``stepping``)."""
