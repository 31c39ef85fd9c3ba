"""The route's unit tests' one check of a refusal: a 400 naming the field."""
from __future__ import annotations

import pytest

from openai_frontend.errors import APIError


def refused(call, param):
    """`call()` raises a 400 APIError whose param is `param`; returns the error."""
    with pytest.raises(APIError) as error:
        call()
    assert error.value.status == 400 and error.value.param == param, error.value.body()
    return error.value
