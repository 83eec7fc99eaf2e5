"""sagellm-plugin-torch: the reference engine on a real model (PyTorch, paged KV)."""
