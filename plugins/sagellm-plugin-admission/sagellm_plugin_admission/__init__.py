"""sagellm admission plugins."""
