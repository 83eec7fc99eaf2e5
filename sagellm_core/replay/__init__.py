"""The embedded replay engine: workloads, a roofline step-time model, and the
continuous-batching loop that drives the runtime in simulated time."""
