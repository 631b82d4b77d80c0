"""KL-coefficient controllers: adapt ``kl.coef`` to keep the measured KL near a target.

Every controller holds the current coefficient (``coef``), moves it once per trainer step with
:meth:`KLController.update`, keeps it in ``[min_coef, max_coef]``, and saves its state with
:meth:`~KLController.state_dict` so that a resumed run continues the same sequence.

Controllers (``type``), with ``r = kl / target_kl - 1`` the relative error of the step's KL:

==================  ========================================================================================
``fixed``           ``coef`` never changes (``kl.coef`` as before).
``proportional``    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (the
                    controller verl and OpenRLHF call adaptive): ``coef *= 1 + clip(r, -0.2, 0.2) * n / horizon``
                    with ``n`` the samples of the step.
``exponential``     ``coef *= exp_factor`` when ``kl > target_kl``, ``coef *= exp_decay`` when ``kl < target_kl``.
``linear``          ``coef *= 1 + linear_factor * clip(r, -1, 1)``.
``pid``             ``coef = initial_coef * (1 + kp * r + ki * sum(r) + kd * (r - r_previous))``; the
                    integral stops growing while the output is clamped (anti-windup).
``schedule``        ``coef`` follows ``schedule_type`` from ``initial_coef`` to ``final_coef`` over
                    ``schedule_steps`` and ignores the KL: ``linear``, ``cosine``, ``exponential``
                    (geometric), ``warmup_cosine`` (linear from 0 over ``warmup_steps``, then cosine).
==================  ========================================================================================

The names follow the enhanced-RL2 document (``exp_factor``, ``exp_decay``, ``linear_factor``,
``kp``/``ki``/``kd``, ``schedule_type``, ``schedule_steps``, ``target_kl``, ``initial_coef``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["KL_CONTROLLERS", "SCHEDULES", "KLController", "make_kl_controller"]

#: The ``type`` values.
KL_CONTROLLERS = ("fixed", "proportional", "exponential", "linear", "pid", "schedule")
#: The ``schedule_type`` values of the ``schedule`` controller.
SCHEDULES = ("linear", "cosine", "exponential", "warmup_cosine")


@dataclasses.dataclass
class KLController:
    """One controller (see the module doc); build it with :func:`make_kl_controller`.

    Attributes:
        type: one of :data:`KL_CONTROLLERS`.
        initial_coef: the coefficient before the first update (> 0 except for ``fixed``).
        target_kl: the KL per token the controller aims at (> 0), in nats, as measured by the
            trainer's estimator (k1/k2/k3).
        min_coef, max_coef: bounds of the coefficient.
        horizon: ``proportional``: samples over which a full error step acts (Ziegler: 10000).
        exp_factor, exp_decay: ``exponential``: multipliers above and below the target.
        linear_factor: ``linear``: gain on the clipped relative error.
        kp, ki, kd: ``pid`` gains on the relative error.
        schedule_type, schedule_steps, warmup_steps, final_coef: ``schedule``.
        coef: the current coefficient.
    """

    type: str = "fixed"
    initial_coef: float = 0.0
    target_kl: float = 0.01
    min_coef: float = 0.0
    max_coef: float = 10.0
    horizon: float = 10000.0
    exp_factor: float = 1.03
    exp_decay: float = 0.99
    linear_factor: float = 0.5
    kp: float = 0.1
    ki: float = 0.01
    kd: float = 0.001
    schedule_type: str = "cosine"
    schedule_steps: int = 1000
    warmup_steps: int = 0
    final_coef: float = 0.0
    coef: float = dataclasses.field(init=False)
    _integral: float = dataclasses.field(init=False, default=0.0)
    _previous: float | None = dataclasses.field(init=False, default=None)
    _steps: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        if self.type not in KL_CONTROLLERS:
            raise ValueError(f"kl controller type must be one of {KL_CONTROLLERS}, got {self.type!r}")
        if self.schedule_type not in SCHEDULES:
            raise ValueError(f"schedule_type must be one of {SCHEDULES}, got {self.schedule_type!r}")
        if self.target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {self.target_kl}")
        if not 0 <= self.min_coef <= self.max_coef:
            raise ValueError(f"need 0 <= min_coef <= max_coef, got {self.min_coef} and {self.max_coef}")
        if self.type not in ("fixed", "schedule") and self.initial_coef <= 0:
            raise ValueError(f"the {self.type} controller multiplies the coefficient: initial_coef must be > 0")
        if (
            self.type == "schedule"
            and self.schedule_type == "exponential"
            and min(self.initial_coef, self.final_coef) <= 0
        ):
            raise ValueError("an exponential schedule needs initial_coef > 0 and final_coef > 0")
        if self.horizon <= 0 or self.schedule_steps < 1 or self.warmup_steps < 0:
            raise ValueError("horizon > 0, schedule_steps >= 1 and warmup_steps >= 0 are required")
        self.coef = self._clamp(self.initial_coef) if self.type != "schedule" else self._scheduled(0)

    def _clamp(self, value: float) -> float:
        return min(max(value, self.min_coef), self.max_coef)

    def _scheduled(self, step: int) -> float:
        start, end = self.initial_coef, self.final_coef
        if self.schedule_type == "warmup_cosine" and step < self.warmup_steps:
            return self._clamp(start * step / self.warmup_steps)
        offset = self.warmup_steps if self.schedule_type == "warmup_cosine" else 0
        span = max(1, self.schedule_steps - offset)
        t = min(1.0, max(0, step - offset) / span)
        if self.schedule_type == "linear":
            value = start + (end - start) * t
        elif self.schedule_type == "exponential":
            value = start * (end / start) ** t
        else:  # cosine, and warmup_cosine after its warm-up
            value = end + (start - end) * 0.5 * (1 + math.cos(math.pi * t))
        return self._clamp(value)

    def update(self, kl: float, samples: int = 1) -> float:
        """Move the coefficient after a step whose mean KL per token was ``kl``; return the new one.

        Args:
            kl: the step's measured KL (the same estimator the loss uses), nats per token.
            samples: sequences in the step (``proportional`` scales its move by ``samples / horizon``).

        Raises:
            ValueError: ``kl`` is not a finite number.
        """
        if not math.isfinite(kl):
            raise ValueError(f"the measured KL must be finite, got {kl}")
        self._steps += 1
        error = kl / self.target_kl - 1.0
        if self.type == "proportional":
            self.coef = self._clamp(self.coef * (1.0 + min(max(error, -0.2), 0.2) * samples / self.horizon))
        elif self.type == "exponential":
            factor = self.exp_factor if kl > self.target_kl else self.exp_decay if kl < self.target_kl else 1.0
            self.coef = self._clamp(self.coef * factor)
        elif self.type == "linear":
            self.coef = self._clamp(self.coef * (1.0 + self.linear_factor * min(max(error, -1.0), 1.0)))
        elif self.type == "pid":
            derivative = 0.0 if self._previous is None else error - self._previous
            self._previous = error
            integral = self._integral + error
            raw = self.initial_coef * (1.0 + self.kp * error + self.ki * integral + self.kd * derivative)
            self.coef = self._clamp(raw)
            if self.coef == raw:  # anti-windup: integrate only while the output is not clamped
                self._integral = integral
        elif self.type == "schedule":
            self.coef = self._scheduled(self._steps)
        return self.coef

    @property
    def active(self) -> bool:
        """Whether a KL term exists at all (a reference model is needed): a non-zero coefficient,
        or a controller that may make it non-zero."""
        return self.type != "fixed" or self.coef > 0

    def metrics(self) -> dict[str, float]:
        """``kl/coef`` for the step's log, and ``kl/target`` for a controller that aims at it
        (not ``fixed`` nor ``schedule``)."""
        if self.type in ("fixed", "schedule"):
            return {"kl/coef": self.coef}
        return {"kl/coef": self.coef, "kl/target": self.target_kl}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the coefficient, the PID memory and the step count."""
        return {"coef": self.coef, "integral": self._integral, "previous": self._previous, "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])
        self._integral = float(state["integral"])
        self._previous = None if state["previous"] is None else float(state["previous"])
        self._steps = int(state["steps"])


def make_kl_controller(coef: float, adaptive: dict[str, Any] | None) -> KLController:
    """The controller of a trainer's ``kl`` config: ``kl.coef`` with ``kl.adaptive`` (a mapping with
    ``type`` and the controller's keys; ``None`` or ``type: fixed`` keeps ``coef`` fixed).
    ``initial_coef`` defaults to ``kl.coef``.

    Raises:
        ValueError: an unknown key (the message lists the valid ones) or a bad value.
    """
    options = dict(adaptive or {})
    options.setdefault("type", "fixed")
    options.setdefault("initial_coef", coef)
    names = {f.name for f in dataclasses.fields(KLController) if f.init}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"kl.adaptive: unknown keys {unknown}; valid keys are {sorted(names)}")
    return KLController(**options)
