"""KL controllers against hand-computed values, a reference loop of Ziegler et al.'s controller,
and a closed loop in which a larger coefficient lowers the KL."""

import math

import pytest

from rl2gem.algorithms.kl_control import KLController, make_kl_controller


def test_proportional_equals_ziegler_reference_loop():
    """The reference: verl's / OpenRLHF's AdaptiveKLController written out here."""
    kls = [0.02, 0.5, 0.0, 0.011, 0.009, 0.03]
    value, expected = 0.2, []
    for kl in kls:
        error = min(max(kl / 0.01 - 1, -0.2), 0.2)
        value *= 1 + error * 64 / 10000
        expected.append(value)
    controller = make_kl_controller(0.2, {"type": "proportional", "target_kl": 0.01, "horizon": 10000})
    assert [controller.update(kl, samples=64) for kl in kls] == pytest.approx(expected, rel=1e-12)


def test_exponential_and_linear_by_hand():
    c = make_kl_controller(0.2, {"type": "exponential", "target_kl": 0.01})
    assert [c.update(kl) for kl in (0.02, 0.005, 0.01)] == pytest.approx([0.206, 0.206 * 0.99, 0.206 * 0.99])
    c = make_kl_controller(1.0, {"type": "linear", "target_kl": 0.01, "linear_factor": 0.5})
    # r = 1, r = 2 clipped to 1, r = -1
    assert [c.update(kl) for kl in (0.02, 0.03, 0.0)] == pytest.approx([1.5, 2.25, 1.125])


def test_pid_by_hand_and_its_anti_windup():
    c = make_kl_controller(1.0, {"type": "pid", "target_kl": 0.01, "kp": 0.1, "ki": 0.01, "kd": 0.001})
    assert c.update(0.02) == pytest.approx(1.11)  # r = 1: 1 + 0.1 + 0.01
    assert c.update(0.01) == pytest.approx(1.009)  # r = 0, integral 1, derivative -1: 1 + 0.01 - 0.001
    clamped = make_kl_controller(
        1.0, {"type": "pid", "target_kl": 0.01, "ki": 0.5, "kp": 0.0, "kd": 0.0, "max_coef": 1.2}
    )
    assert [clamped.update(0.02) for _ in range(3)] == pytest.approx([1.2, 1.2, 1.2])
    assert clamped.update(0.01) == pytest.approx(1.0)  # the integral did not wind up while clamped


def test_schedules_by_hand():
    def values(kind, **kw):
        c = make_kl_controller(
            0.4, {"type": "schedule", "schedule_type": kind, "schedule_steps": 4, "final_coef": 0.1, **kw}
        )
        return [c.coef] + [c.update(123.0) for _ in range(5)]  # the KL is ignored

    assert values("linear") == pytest.approx([0.4, 0.325, 0.25, 0.175, 0.1, 0.1])
    cosine = [0.1 + 0.3 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(5)] + [0.1]
    assert values("cosine") == pytest.approx(cosine)
    assert values("exponential")[2] == pytest.approx(math.sqrt(0.4 * 0.1))  # geometric halfway
    warm = values("warmup_cosine", warmup_steps=2)
    assert warm[:3] == pytest.approx([0.0, 0.2, 0.4]) and warm[4] == pytest.approx(0.1)


def test_bounds_and_errors():
    c = make_kl_controller(0.5, {"type": "exponential", "target_kl": 0.01, "exp_factor": 2.0, "max_coef": 1.5})
    assert [c.update(1.0) for _ in range(3)] == [1.0, 1.5, 1.5]
    c = make_kl_controller(0.5, {"type": "exponential", "target_kl": 0.01, "exp_decay": 0.1, "min_coef": 0.01})
    assert [c.update(0.0) for _ in range(3)] == pytest.approx([0.05, 0.01, 0.01])
    assert make_kl_controller(0.3, None).update(5.0) == 0.3  # fixed
    with pytest.raises(ValueError, match="valid keys"):
        make_kl_controller(0.1, {"type": "pid", "kq": 1.0})
    with pytest.raises(ValueError, match="must be one of"):
        make_kl_controller(0.1, {"type": "bang_bang"})
    with pytest.raises(ValueError, match="initial_coef must be > 0"):
        make_kl_controller(0.0, {"type": "exponential"})
    with pytest.raises(ValueError, match="finite"):
        make_kl_controller(0.1, {"type": "pid"}).update(float("nan"))


@pytest.mark.parametrize("kind", ["proportional", "exponential", "linear", "pid", "schedule"])
def test_state_dict_resumes_the_same_sequence(kind):
    options = {"type": kind, "target_kl": 0.01, "final_coef": 0.05, "schedule_steps": 6}
    kls = [0.02, 0.004, 0.015, 0.03, 0.0, 0.012]
    whole = make_kl_controller(0.2, options)
    expected = [whole.update(kl, samples=500) for kl in kls]
    first = make_kl_controller(0.2, options)
    for kl in kls[:3]:
        first.update(kl, samples=500)
    resumed = make_kl_controller(0.2, options)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.update(kl, samples=500) for kl in kls[3:]] == pytest.approx(expected[3:], rel=0, abs=0)


@pytest.mark.parametrize(
    "options",
    [
        {"type": "proportional", "horizon": 10000},
        {"type": "exponential"},
        {"type": "linear", "linear_factor": 0.3},
        {"type": "pid", "kp": 1.0, "ki": 0.5, "kd": 0.0},
    ],
)
def test_closed_loop_settles_near_the_target(options):
    """A plant where the policy drifts less the larger the penalty: kl = 0.04 / (1 + 20 coef).
    The target 0.01 needs coef = 0.15; every adaptive controller starts at 0.02 and gets there."""
    controller = KLController(initial_coef=0.02, target_kl=0.01, **options)
    kl = None
    for _ in range(400):
        kl = 0.04 / (1 + 20 * controller.coef)
        controller.update(kl, samples=5000)
    assert kl == pytest.approx(0.01, rel=0.1) and controller.coef == pytest.approx(0.15, rel=0.2)
    assert controller.metrics() == {"kl/coef": controller.coef, "kl/target": 0.01}
