"""Errors a user sees. Each renders as one line naming the culprit."""


class SagellmError(Exception):
    """Base class: ``str(err)`` is the whole message, one line."""


class ConfigError(SagellmError):
    """A config file is malformed, names an unknown plugin, or a bad value."""


class PluginStartError(ConfigError):
    """A plugin the config picks failed to import or to start."""


class PluginError(SagellmError):
    """A plugin broke its contract (returned nonsense, raised)."""


class TraceError(SagellmError):
    """A workload file has a line that cannot be read."""


class RequestError(SagellmError):
    """A request an engine cannot serve (an empty prompt, one longer than the
    KV pool can ever hold); nothing was changed for it."""
