"""Shared TritonPythonModel skeleton for the decoupled models that own an engine
(`llm`: text in/out, `tensorrt_llm`: token ids in/out)."""
from __future__ import annotations

import itertools
import time
from typing import Any

from backend import triton_io
from backend.config_params import split_parameters
from backend.engine_loop import EngineLoop, Inflight
from backend.metrics import NullMetrics, TritonMetrics
from backend.request_parsing import InvalidRequest
from backend.response_worker import ResponseWorker


class EngineModel:
    """Subclasses implement `make_inflight(request, request_id, arrival)`."""

    def initialize(self, args: dict[str, Any]) -> None:
        config = triton_io.parse_model_config(args)
        if not config.get("model_transaction_policy", {}).get("decoupled", False):
            raise ValueError(f"model {args['model_name']!r} must set model_transaction_policy "
                             "{ decoupled: true }")
        engine_config, self.options = split_parameters(triton_io.model_parameters(config))
        self.input_names = triton_io.input_names(config)
        self.model_name = args["model_name"]
        from engine import LLMEngine  # heavy (torch); after the cheap checks

        started = time.monotonic()
        metrics = (TritonMetrics(self.model_name, args["model_version"])
                   if self.options.report_custom_metrics else NullMetrics())
        self._worker = ResponseWorker(metrics)
        try:
            self._loop = EngineLoop(lambda: LLMEngine(engine_config), self._worker,
                                    collect_metrics=self.options.report_custom_metrics)
        except BaseException:
            self._worker.stop()
            raise
        self.engine = self._loop.engine
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        triton_io.log_info(f"{self.model_name}: engine ready in {time.monotonic() - started:.1f} s "
                           f"({engine_config.model or 'embedded SmolLM2-135M-Instruct'})")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            # Unique even when clients reuse Triton request ids.
            request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
            try:
                inflight = self.make_inflight(request, request_id, sender, time.monotonic())
            except InvalidRequest as exc:
                triton_io.send_error(sender, str(exc), triton_io.INVALID_ARG)
                continue
            except Exception as exc:  # noqa: BLE001 - a bad request must never reach the server
                triton_io.send_error(sender, f"could not parse request: {exc}", triton_io.INVALID_ARG)
                continue
            self._loop.submit(inflight)
        return None

    def make_inflight(self, request: Any, request_id: str, sender: Any, arrival: float) -> Inflight:
        raise NotImplementedError

    def finalize(self) -> None:
        self._loop.stop(self.options.drain_timeout_s)
        self._worker.stop()
