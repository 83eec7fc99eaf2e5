"""The routing decision of a cluster (``[router]``): the plugin a config
picks, behind a checked call. An engine that runs several instances (the
cluster replay, a serving front) asks it once per request; a plugin that
raises, passes, or names an instance that is not there or cannot take the
request is a one-line :class:`PluginError` naming it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sagellm_core import hookspecs
from sagellm_core.config import Settings
from sagellm_core.dispatch import Dispatch, PluginManager
from sagellm_core.errors import ConfigError, PluginError, PluginStartError, SagellmError
from sagellm_core.registry import PluginContext, build_settings, load_class
from sagellm_core.timing import HookTimer
from sagellm_core.types import InstanceLoad, Request, RouteDecision

HOOK = "sagellm_route_request"
#: The roles that compute a prompt; a decode instance only takes KV.
PROMPT_ROLES = ("colocated", "prefill")


class Router:
    """``settings.router``'s plugin, asked through :meth:`route`; its calls
    timed in ``timer`` when the config's report times hooks."""

    def __init__(self, settings: Settings):
        sel = settings.router
        if sel is None:
            raise ConfigError(f"{settings.path}: missing section [router]; it picks how requests are routed")
        cls, self.info = load_class("router", sel.name, sel.where)
        plugin_settings = build_settings(cls, sel.params, f"{sel.where} plugin {sel.name!r}")
        folder = str(Path(settings.path).parent) if Path(settings.path).is_file() else None
        context = PluginContext(
            sel.name, settings.block_size, settings.num_blocks, settings.workload.seed, config_dir=folder
        )
        try:
            self.plugin = cls(plugin_settings, context)
        except SagellmError:
            raise
        except (Exception, SystemExit) as exc:
            raise PluginStartError(f"{sel.where}: plugin {sel.name!r} failed to start: {exc}") from exc
        if not hasattr(self.plugin, HOOK):
            raise ConfigError(f"{sel.where}: router plugin {sel.name!r} does not implement {HOOK}")
        #: The plugin's name in the config, and as error messages name it.
        self.plugin_name = sel.name
        self.name = f"router plugin {sel.name!r}"
        pm = PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(self.plugin, name=f"router:{sel.name}")
        self.timer = HookTimer() if settings.report.hook_timing else None
        self._dispatch = Dispatch(pm, self.timer)

    def route(self, request: Request, instances: Sequence[InstanceLoad], now_s: float) -> RouteDecision:
        """The plugin's decision for ``request`` among ``instances``, checked."""
        try:
            decision = self._dispatch.call(HOOK, {"request": request, "instances": instances, "now_s": now_s})
        except (Exception, SystemExit) as exc:
            message = " ".join(str(exc).split())
            raise PluginError(f"{self.name} raised in {HOOK}: {type(exc).__name__}: {message}") from exc
        problem = check_route(decision, instances)
        if problem:
            raise PluginError(f"{self.name} answered {HOOK} for request {request.request_id!r} with {problem}")
        return decision  # type: ignore[no-any-return]


def check_route(decision: object, instances: Sequence[InstanceLoad]) -> str | None:
    """What is wrong with ``decision`` among ``instances``; ``None`` if nothing."""
    if not isinstance(decision, RouteDecision):
        return f"{type(decision).__name__}, not a RouteDecision" if decision is not None else "no answer (None)"
    roles = {i.instance_id: i.role for i in instances}
    role = roles.get(decision.instance_id)
    if role not in PROMPT_ROLES:
        what = "no such instance" if role is None else f"a {role} instance"
        return f"instance {decision.instance_id!r}: {what}; a colocated or prefill instance computes the prompt"
    decode = decision.decode_instance_id
    if role == "prefill" and roles.get(decode) != "decode":  # type: ignore[arg-type]
        return f"decode instance {decode!r} for prefill instance {decision.instance_id!r}: not a decode instance"
    if role == "colocated" and decode is not None:
        return f"decode instance {decode!r} for colocated instance {decision.instance_id!r}, which decodes itself"
    return None
