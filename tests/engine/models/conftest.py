"""Fixtures shared by the model tests."""
import pytest

from engine.models import single_decode


@pytest.fixture
def fused_steps(monkeypatch) -> list:
    """Every call of the fused decode step from here on, as (rows, hidden): hidden None is
    a step the plan refused, which the layer path then took."""
    calls = []
    fused_run = single_decode.run

    def recording_run(plan, embedding, *args):
        hidden = fused_run(plan, embedding, *args)
        calls.append((embedding.shape[0], hidden))
        return hidden

    monkeypatch.setattr(single_decode, "run", recording_run)
    return calls
