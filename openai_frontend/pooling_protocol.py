"""The request bodies of /v1/embeddings (OpenAI's names, with vLLM's extras), /score and
/rerank (vLLM 0.32's names; /rerank is Cohere's and Jina's shape).

`model` may be left out, as vLLM allows: the served model answers."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from openai_frontend.errors import bad_request
from openai_frontend.protocol import _Body


class PoolingFields(_Body):
    model: str | None = None
    # OpenAI's end-user id: accepted, no effect (a pooling request has no tenant here).
    user: str | None = None
    # vLLM's: keep the last k prompt tokens (-1: up to max_model_len), as the `llm`
    # model's pooling_params take it.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's: false skips the normalisation (an embedder) or the sigmoid (a cross-encoder).
    use_activation: bool | None = None
    priority: int | None = None


class EmbeddingRequest(PoolingFields):
    # Strict: pydantic would otherwise read true or 2.0 as the id 1 or 2.
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_form(cls, value: Any) -> Any:
        from openai_frontend.pooling import split_inputs

        split_inputs(value)  # a 400 naming `input` that says what is wrong
        return value


Texts = Union[StrictStr, list[StrictStr]]


class ScoreRequest(PoolingFields):
    """vLLM's text_1 / text_2; its other spellings (queries / documents, data_1 / data_2)
    are read as the same two fields."""
    text_1: Texts
    text_2: Texts

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "text_1" not in data:
            for first, second in (("queries", "documents"), ("data_1", "data_2"),
                                  ("queries", "items")):
                if first in data and second in data:
                    data = {**data, "text_1": data[first], "text_2": data[second]}
                    break
        return data


class RerankRequest(PoolingFields):
    query: StrictStr
    documents: list[StrictStr]
    # 0: every document (vLLM's default).
    top_n: int = Field(default=0, ge=0)

    @field_validator("documents")
    @classmethod
    def _some_documents(cls, value: list[str]) -> list[str]:
        if not value:
            raise bad_request("documents must not be empty", "documents")
        return value
