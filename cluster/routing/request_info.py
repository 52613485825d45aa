"""What a router reads from a pending ``generate(req, handoff)`` call: the acceptance estimate
(prefill's probe, else the request's own, else a prior from its temperature) and prompt length."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cluster.routing.policies import RouteRequest
from kvtransfer.handoff import KVHandoff, LeaseRelease
from models.request import Request
from speculation.calibration import DEFAULT_ACCEPTANCE, CalibrationPool, calibration_key


def acceptance_prior(temperature: float) -> float:
    """The estimate without a probe: ``DEFAULT_ACCEPTANCE`` when greedy, half of it from
    temperature 1 up, linear in between."""
    return DEFAULT_ACCEPTANCE * (1.0 - 0.5 * min(max(temperature, 0.0), 1.0))


def _first(values: Iterable[Any], kind: type) -> Any:
    return next((v for v in values if isinstance(v, kind)), None)


def request_of(args: Iterable[Any], kwargs: Mapping[Any, Any]) -> Request | None:
    values = [*args, *kwargs.values()]
    req: Request | None = _first(values, Request)
    return req


def release_of(args: Iterable[Any], kwargs: Mapping[Any, Any]) -> LeaseRelease | None:
    found: LeaseRelease | None = _first([*args, *kwargs.values()], LeaseRelease)
    return found


def route_request(
    args: Iterable[Any], kwargs: Mapping[Any, Any], calibration: CalibrationPool | None = None
) -> RouteRequest | None:
    """The decode policy's view of ``generate(req, handoff)``; None if there is no Request.
    ``calibration`` calibrates the estimate by temperature and probe bin, as the engine will."""
    values = [*args, *kwargs.values()]
    req: Request | None = _first(values, Request)
    if req is None:
        return None
    handoff: KVHandoff | None = _first(values, KVHandoff)
    probe = handoff.acceptance_probe if handoff is not None else None
    if probe is not None:
        alpha = probe
    elif req.acceptance_estimate is not None:
        alpha = req.acceptance_estimate
    else:
        alpha = acceptance_prior(req.sampling.temperature)
    if calibration is not None:
        temperature = 0.0 if req.sampling.greedy else req.sampling.temperature
        alpha = calibration.estimate(calibration_key(probe, temperature), alpha)
    tokens = handoff.num_tokens if handoff is not None else len(req.prompt_token_ids)
    return RouteRequest(alpha=alpha, prompt_tokens=tokens, greedy=req.sampling.greedy)
