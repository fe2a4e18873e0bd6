from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field

import pytest

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.core.pickling import pickle_by_fields
from dualpath.sched.cost import coefficients_for
from dualpath.sched.params import derive_scheduler_params
from dualpath.sched.types import EngineReport, ReadPlan, Role, WaitingRequest


def test_scheduler_messages_round_trip_through_pickle_and_copy() -> None:
    model, hw = model_preset("deepseek-v3.2"), hardware_preset("h800-deepseek")
    objs = [
        derive_scheduler_params(model, hw),
        coefficients_for(model, hw),
        EngineReport(3, 1, Role.DECODE, 2, 900, 4096, 10**9),
        WaitingRequest(7, 1000, 960, 50),
        ReadPlan(0, 1, 10, 4, 64),
    ]
    for obj in objs:
        back = pickle.loads(pickle.dumps(obj))
        assert back == obj and type(back) is type(obj)
        assert copy.deepcopy(obj) == obj


def test_only_dataclasses_with_init_fields_can_register() -> None:
    class Plain:
        pass

    @dataclass(frozen=True)
    class Derived:
        a: int
        b: int = field(init=False, default=0)

    with pytest.raises(TypeError, match="not a dataclass"):
        pickle_by_fields(Plain)
    with pytest.raises(TypeError, match="outside __init__"):
        pickle_by_fields(Derived)


def test_user_facing_errors_survive_a_process_boundary() -> None:
    """A bad spec raised in a worker (`Runner(jobs=N)`) reaches the parent as itself, with its
    one-line message, not as a broken process pool."""
    from dualpath.core.errors import SpecError, UnknownPresetError
    from dualpath.workload.trace_errors import TraceFormatError

    errors: list[Exception] = [
        SpecError("scheduler", "beta_tokens", "x", "must be a number"),
        UnknownPresetError("mode", "fast", ["basic", "dualpath"]),
        TraceFormatError("t.jsonl", 3, "must be >= 0", field="input_length"),
        TraceFormatError("t.jsonl", 0, "empty file"),
    ]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert vars(back) == vars(err)
