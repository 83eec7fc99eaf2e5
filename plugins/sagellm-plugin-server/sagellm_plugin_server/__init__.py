"""sagellm-plugin-server: an OpenAI-compatible server for the torch engine,
Prometheus metrics, KV stats, and a load generator (`sagellm serve`,
`sagellm bench serve`)."""
