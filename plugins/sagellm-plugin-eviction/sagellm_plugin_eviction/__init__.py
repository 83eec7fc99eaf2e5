"""sagellm eviction plugins."""
