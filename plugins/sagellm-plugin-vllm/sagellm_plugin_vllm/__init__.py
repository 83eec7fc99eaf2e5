"""sagellm inside vLLM. ``SagellmScheduler`` and ``SagellmAsyncScheduler``
import vLLM; importing this package alone does not."""


def __getattr__(name: str):
    if name in ("SagellmScheduler", "SagellmAsyncScheduler"):
        from sagellm_plugin_vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(name)
