"""sagellm clusters: routing, KV events, prefill/decode disaggregation."""
