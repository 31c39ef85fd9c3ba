"""backend.config_params: config.pbtxt parameters -> EngineConfig + backend options."""
from __future__ import annotations

import pytest

from backend.config_params import split_parameters
from engine.faults import FaultPlan, take_fault_parameters


def test_engine_and_backend_parameters_are_split():
    config, options = split_parameters({"model": "", "max_num_seqs": "8", "enable_prefix_caching": "false",
                                        "REPORT_CUSTOM_METRICS": "yes", "DRAIN_TIMEOUT_S": "2.5"})
    assert config.model is None and config.scheduler.max_num_seqs == 8
    assert config.cache.enable_prefix_caching is False
    assert options.report_custom_metrics and options.drain_timeout_s == 2.5


@pytest.mark.parametrize("params,fragment", [
    ({"max_num_seqs": "lots"}, "max_num_seqs"),
    ({"max_num_seqs": "0"}, "max_num_seqs"),
    ({"policy": "random"}, "policy"),
    ({"no_such_arg": "1"}, "no_such_arg"),
    ({"REPORT_CUSTOM_METRICS": "perhaps"}, "REPORT_CUSTOM_METRICS"),
])
def test_bad_parameter_is_named(params, fragment):
    with pytest.raises(ValueError, match=fragment):
        split_parameters(params)


def test_admission_and_health_options():
    _, options = split_parameters({"MAX_QUEUE_LEN": "8", "ENABLE_VLLM_HEALTH_CHECK": "true"})
    assert options.max_queue_len == 8 and options.enable_health_check
    _, defaults = split_parameters({})
    assert defaults.max_queue_len == 1024 and not defaults.enable_health_check


def test_fault_parameters_are_taken_before_the_engine_and_backend_see_the_rest():
    """A test model's failure switches never reach EngineConfig or BackendOptions."""
    plan, rest = take_fault_parameters({"INJECT_LOOP_FAILURE_AT_STEP": "3",
                                        "inject_failure_at_step": "5", "max_num_seqs": "4"})
    assert plan == FaultPlan(model_step=5, loop_step=3) and rest == {"max_num_seqs": "4"}
    assert take_fault_parameters({}) == (FaultPlan(), {})
    with pytest.raises(ValueError, match="INJECT_LOOP_FAILURE_AT_STEP"):
        take_fault_parameters({"INJECT_LOOP_FAILURE_AT_STEP": "soon"})
    with pytest.raises(ValueError, match="model_step"):
        FaultPlan(model_step=-1)
    # Only through that seam: as engine or backend parameters they are unknown.
    with pytest.raises(ValueError, match="inject_failure_at_step"):
        split_parameters({"inject_failure_at_step": "5"})


@pytest.mark.parametrize("key,value", [("MAX_QUEUE_LEN", "-1"), ("MAX_QUEUE_LEN", "many"),
                                       ("ENABLE_VLLM_HEALTH_CHECK", "sometimes"),
                                       ("DRAIN_TIMEOUT_S", "nan"), ("DRAIN_TIMEOUT_S", "inf"),
                                       ("DRAIN_TIMEOUT_S", "-0.5"), ("MAX_QUEUE_LEN", "1.5")])
def test_bad_backend_option_is_named(key, value):
    with pytest.raises(ValueError, match=key):
        split_parameters({key: value})
