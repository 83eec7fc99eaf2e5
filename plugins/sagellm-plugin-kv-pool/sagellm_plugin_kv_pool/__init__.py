"""sagellm kv-pool plugins."""
