"""sagellm KV stores: tiers of KV blocks below the device pool."""
