"""sagellm kv-transport plugins."""
