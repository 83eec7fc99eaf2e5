"""sagellm prefix-cache plugins."""
