"""``[lifetime] plugin = "online"``: an online quantile regression on cheap
features (:mod:`.features`: conversation turn and earlier replies' lengths,
prefix identity, prompt size, tenant). A linear model per quantile of
``log1p(output tokens)``, fitted by AdaGrad steps on the pinball loss, one
per finished request, so it needs no training run and follows drift. A
near-duplicate of an earlier prompt is predicted that prompt's reply length."""

from __future__ import annotations

import numpy as np
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction, Request, RequestOutcome

from .features import FEATURE_NAMES, History, PendingFeatures, log_tokens
from .quantiles import prediction


@frozen
class OnlineSettings:
    learning_rate: float = field(default=0.2, validator=[validators.instance_of(float), validators.gt(0)])
    #: Finished requests before predictions are fully trusted (confidence).
    warmup: int = field(default=500, validator=[validators.instance_of(int), validators.gt(0)])
    #: The median prediction before anything has finished.
    prior_tokens: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    max_sessions: int = field(default=100_000, validator=[validators.instance_of(int), validators.gt(0)])
    #: A prompt at least this similar to an earlier one is predicted that
    #: one's reply length (:mod:`.near_duplicates`); over 1 turns it off.
    duplicate_similarity: float = field(default=0.95, validator=[validators.instance_of(float), validators.ge(0)])


class OnlineQuantileRegression:
    """The model alone, usable outside a runtime (evaluation, tests)."""

    def __init__(self, num_features: int, learning_rate: float, prior_tokens: int):
        self.levels = np.array(QUANTILE_LEVELS)
        self.weights = np.zeros((len(QUANTILE_LEVELS), num_features))
        # Start every quantile at the prior, through the bias feature.
        self.weights[:, 0] = log_tokens(prior_tokens)
        self.grad_squares = np.full_like(self.weights, 1e-8)
        self.learning_rate = learning_rate
        self.updates = 0

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.weights @ x

    def update(self, x: np.ndarray, target: float) -> None:
        above = target > self.weights @ x
        # d pinball / d prediction: -q where the target is above, 1 - q below.
        dloss = np.where(above, -self.levels, 1.0 - self.levels)
        grad = np.outer(dloss, x)
        self.grad_squares += grad * grad
        self.weights -= self.learning_rate * grad / np.sqrt(self.grad_squares)
        self.updates += 1


class OnlineLifetime:
    Settings = OnlineSettings

    def __init__(self, settings: OnlineSettings, context: PluginContext):
        self.settings = settings
        self.name = context.name
        self.history = History(
            context.block_size, settings.max_sessions, duplicate_similarity=settings.duplicate_similarity
        )
        self.model = OnlineQuantileRegression(len(FEATURE_NAMES), settings.learning_rate, settings.prior_tokens)
        #: Features as they were at arrival, for the update at finish
        #: (bounded: a request that never finishes must not stay forever).
        self._pending = PendingFeatures()

    @hookimpl
    def sagellm_predict_lifetime(self, request: Request) -> LifetimePrediction:
        x = np.array(self.history.features(request))
        self._pending[request.request_id] = x
        trust = self.model.updates / self.settings.warmup
        return prediction(self.model.predict(x), self.name, trust, self.history.near_duplicate(request))

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        request = outcome.request
        x = self._pending.pop(request.request_id, None)
        if x is None:
            x = np.array(self.history.features(request))
        self.model.update(x, log_tokens(outcome.num_output_tokens))
        self.history.observe(request, outcome.num_output_tokens)
