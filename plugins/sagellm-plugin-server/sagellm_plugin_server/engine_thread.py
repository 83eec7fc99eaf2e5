"""The torch engine in a thread of its own, beside the server's event loop.

The engine's step loop is synchronous and CPU-bound; running it in the event
loop would stall every connection for a step. So one thread owns the
:class:`~sagellm_plugin_torch.engine.EngineCore` and everything it touches
(the runtime, the plugins): the event loop hands it commands (add, abort,
read stats) through a queue, and it hands each request's outputs back to the
loop through ``call_soon_threadsafe``. Nothing else calls the engine, so no
lock is needed around it.

A request for ``n`` choices is ``n`` engine requests that share the
prompt's KV blocks through the prefix cache: the first is added at once,
and its siblings once its first token is out, which is when the runtime
has cached its prompt's full blocks (``EngineCore`` caches them then), so
each sibling's admission hits all of them and computes only the prompt's
partial last block. Without a prefix cache there is nothing to share: all
``n`` are added at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sagellm_plugin_torch.engine import EngineCore
from sagellm_plugin_torch.sampling import SamplingParams

from sagellm_core.drivers.step_engine import StepOutput
from sagellm_core.errors import RequestError
from sagellm_core.types import Request


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``."""


class EngineThread:
    def __init__(self, core: EngineCore, max_waiting: int, observe: Callable[[StepOutput], None] = lambda out: None):
        self.core = core
        #: Called on the engine thread with every output, aborts included.
        self.observe = observe
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        #: The siblings of a group's first request, waiting for its first token.
        self._siblings: dict[str, list[tuple[Request, SamplingParams]]] = {}
        self._shares_prompts = "prefix_cache" in core.rt.host.plugins
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sagellm-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wake it
        self._thread.join(timeout=30)

    # ------------------------------------------------- from the event loop --

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread, between steps; return its result."""
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit(self, group: list[tuple[Request, SamplingParams]], prefetch: bool = False) -> asyncio.Queue:
        """Queue a group of requests for one prompt (``n`` choices; one
        request for ``n = 1``); the outputs of all of them arrive on the
        returned queue. With ``prefetch``, the first request's blocks that
        the KV stores hold start moving up the tiers as it is queued
        (``Runtime.prefetch``), so they are loaded, or counted late or
        wasted, when it is admitted. Raises RequestError (they can never be
        served) or QueueFull, with nothing queued."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def add() -> None:
            waiting = len(self.core.waiting) + sum(len(s) for s in self._siblings.values())
            if waiting + len(group) > self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (max_waiting {self.max_waiting})")
            # The first is checked first: its siblings share its prompt and
            # max_tokens, so what it passes, they pass.
            (first, sampling), siblings = group[0], group[1:]
            for request, params in [(first, sampling), *(siblings if not self._shares_prompts else [])]:
                self.core.add_request(request, params)
            if prefetch:
                self.core.rt.prefetch(self.core.requests[first.request_id])
            if siblings and self._shares_prompts:
                self._siblings[first.request_id] = list(siblings)
            for request, _ in group:
                self._streams[request.request_id] = (loop, outputs)

        await self.call(add)
        return outputs

    def abort_nowait(self, request_id: str) -> None:
        """Stop a request: the engine thread frees its blocks before its next
        step. Safe from a cancelled task (a client that went away)."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            for siblings in self._siblings.values():
                siblings[:] = [(r, p) for r, p in siblings if r.request_id != request_id]
            out = self.core.abort(request_id)
            if out is not None:
                self.observe(out)
            # A first request aborted before its first token: its siblings
            # go on without the shared prompt.
            self._release(self._siblings.pop(request_id, []), rejected=False)

        self._commands.put((abort, Future()))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------- on the engine thread --

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.core.has_work()
                try:
                    while True:
                        fn, future = self._commands.get(block=block, timeout=0.5 if block else None)
                        block = False
                        self._execute(fn, future)
                except queue.Empty:
                    pass
                if self.core.has_work():
                    self._deliver(self.core.step())
        except BaseException as exc:  # the engine is broken: fail every stream
            self.error = exc
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, exc)
            raise

    @staticmethod
    def _execute(fn: Callable[[], Any], future: Future) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - raised again in the caller (RequestError, QueueFull, ...)
                future.set_exception(exc)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self.observe(out)
            siblings = self._siblings.pop(out.request_id, None)
            if siblings:
                self._release(siblings, rejected=out.finish_reason == "rejected")
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, out)
            if out.finished:
                del self._streams[out.request_id]

    def _release(self, siblings: list[tuple[Request, SamplingParams]], rejected: bool) -> None:
        """Add a group's siblings now that its first request's prompt is
        cached; if that request could never fit the pool, neither can they."""
        for request, sampling in siblings:
            if not rejected:
                try:
                    self.core.add_request(request, sampling)
                    continue
                except RequestError:
                    pass
            self.core.rt.reject(self.core.rt.arrive(request))
            self._deliver([StepOutput(request.request_id, None, True, "rejected")])
