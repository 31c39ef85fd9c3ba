"""`preprocessing` (text -> ids) and `postprocessing` (ids -> text) for the ensemble.

Both are plain (non-decoupled) models that handle a whole batch per call; they load
only the tokenizer, not the model weights: the engine model's tokenizer, found as
backend/tokenizer_source.py explains."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from backend import triton_io
from backend.input_values import InvalidRequest, decode_text
from backend.token_responses import decode_after, decode_ids
from backend.tokenizer_source import tokenizer_source
from engine.api import load_tokenizer


class _TokenizerModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = triton_io.model_parameters(triton_io.parse_model_config(args))
        source = tokenizer_source(args["model_name"], params, Path(args["model_repository"]))
        self.tokenizer = load_tokenizer(source.model, source.tokenizer)
        triton_io.log_info(f"{args['model_name']}: tokenizer of {source.shown}")

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(triton_io.make_response(self.process(request)))
            except InvalidRequest as exc:
                responses.append(triton_io.make_error(str(exc)))
        return responses

    def process(self, request: Any) -> dict[str, np.ndarray]:
        raise NotImplementedError


def _words(tokenizer: Any, array: np.ndarray | None, batch: int) -> np.ndarray:
    """Per batch item, a list of words -> TensorRT-LLM's [batch, 2, L] id/offset form."""
    rows: list[tuple[list[int], list[int]]] = []
    for i in range(batch):
        words = [] if array is None else [decode_text("stop/bad words", w) for w in np.asarray(array)[i].reshape(-1)]
        ids: list[int] = []
        offsets: list[int] = []
        for word in words:
            if word:
                ids.extend(tokenizer.encode(word, add_special_tokens=False))
                offsets.append(len(ids))
        rows.append((ids, offsets))
    width = max(1, max(max(len(ids), len(off)) for ids, off in rows))
    out = np.zeros((batch, 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, (ids, offsets) in enumerate(rows):
        out[i, 0, :len(ids)] = ids
        out[i, 1, :len(offsets)] = offsets
    return out


class PreprocessingModel(_TokenizerModel):
    def process(self, request: Any) -> dict[str, np.ndarray]:
        inputs = triton_io.read_inputs(request, ("QUERY", "STOP_WORDS_DICT", "BAD_WORDS_DICT"))
        queries = inputs["QUERY"]
        batch = queries.shape[0]
        # Same tokenization as the engine applies to a text prompt, so the ensemble and
        # the `llm` model see identical ids.
        encoded = [self.tokenizer.encode(decode_text("text_input", q)) for q in queries.reshape(batch, -1)[:, 0]]
        if any(not ids for ids in encoded):
            raise InvalidRequest("text_input must not be empty")
        width = max(len(ids) for ids in encoded)
        input_ids = np.zeros((batch, width), dtype=np.int32)
        for i, ids in enumerate(encoded):
            input_ids[i, :len(ids)] = ids
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": np.array([[len(ids)] for ids in encoded], dtype=np.int32),
            "STOP_WORDS_IDS": _words(self.tokenizer, inputs["STOP_WORDS_DICT"], batch),
            "BAD_WORDS_IDS": _words(self.tokenizer, inputs["BAD_WORDS_DICT"], batch),
        }


class PostprocessingModel(_TokenizerModel):
    def process(self, request: Any) -> dict[str, np.ndarray]:
        inputs = triton_io.read_inputs(request, ("TOKENS_BATCH", "SEQUENCE_LENGTH", "PREFIX_IDS"))
        tokens = inputs["TOKENS_BATCH"]  # [batch, beam, n]
        lengths = inputs["SEQUENCE_LENGTH"]  # [batch, beam]
        prefixes = inputs["PREFIX_IDS"]  # [batch, k], -1 padded; optional
        batch, beams = tokens.shape[0], tokens.shape[1]
        decode = functools.partial(decode_ids, self.tokenizer)
        texts = []
        for b in range(batch):
            prefix = [] if prefixes is None else [int(t) for t in prefixes[b] if t >= 0]
            for k in range(beams):
                ids = [int(t) for t in tokens[b, k, :int(lengths[b, k])]]
                # See backend/token_responses.py for why the prefix is decoded too.
                texts.append(decode_after(decode, prefix, ids))
        return {"OUTPUT": triton_io.string_array(texts, (batch, beams))}
