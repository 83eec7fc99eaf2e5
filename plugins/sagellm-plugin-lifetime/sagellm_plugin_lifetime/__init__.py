"""sagellm lifetime plugins."""
