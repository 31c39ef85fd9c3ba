"""Failures on purpose, for the tests of what a failure leaves behind. They enter through
this one object, handed to the engine and the backend's loop beside (never inside) the
configuration a user writes, so no user-facing config type carries a test switch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from engine.values import convert

# config.pbtxt parameters that carry a FaultPlan (a test model's config) -> its field.
FAULT_PARAMETERS = {"inject_failure_at_step": "model_step",
                    "INJECT_LOOP_FAILURE_AT_STEP": "loop_step"}


class InjectedFailure(RuntimeError):
    """Raised where a FaultPlan says so."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    # The model runner raises at this (1-based) serving step, once; 0: never.
    model_step: int = 0
    # The backend's engine loop raises outside engine.step() after this step; 0: never.
    loop_step: int = 0

    def __post_init__(self) -> None:
        for name in ("model_step", "loop_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FaultPlan.{name} must be an integer >= 0, got {value!r}")


def take_fault_parameters(params: Mapping[str, str]) -> tuple[FaultPlan, dict[str, str]]:
    """Splits a model's parameters into its FaultPlan and the rest."""
    plan, rest = {}, {}
    for key, value in params.items():
        if key in FAULT_PARAMETERS:
            plan[FAULT_PARAMETERS[key]] = convert(f"parameter {key!r}", value, "int")
        else:
            rest[key] = value
    return FaultPlan(**plan), rest
