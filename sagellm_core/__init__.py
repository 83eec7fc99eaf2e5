"""sagellm: pluggable KV-cache management for LLM serving.

Plugin authors need :data:`hookimpl` and the value types in
:mod:`sagellm_core.types`; nothing else of the core.
"""

from sagellm_core.hookspecs import hookimpl
from sagellm_core.registry import PluginContext

__version__ = "0.1.0"
__all__ = ["hookimpl", "PluginContext", "__version__"]
