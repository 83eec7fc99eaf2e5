"""sagellm scheduler-ir plugins."""
