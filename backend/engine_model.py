"""Shared TritonPythonModel skeleton for the decoupled models that own an engine
(`llm`: text in/out, `tensorrt_llm`: token ids in/out).

Engine arguments come from the version folder's model.json (vllm_backend's file) and
the config.pbtxt parameters, which win (backend/config_params.py)."""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from backend import triton_io
from backend.config_params import split_parameters
from backend.engine_loop import EngineLoop
from backend.instance import place_instance
from backend.inflight import Inflight
from backend.metrics import NullMetrics, TritonMetrics
from backend.model_json import read_model_json
from backend.request_parsing import InvalidRequest
from backend.response_worker import ResponseWorker
from engine.faults import take_fault_parameters


class EngineModel:
    """The Triton side of an engine model; subclasses implement `make_inflight`."""

    def initialize(self, args: dict[str, Any]) -> None:
        config = triton_io.parse_model_config(args)
        if not config.get("model_transaction_policy", {}).get("decoupled", False):
            raise ValueError(f"model {args['model_name']!r} must set model_transaction_policy "
                             "{ decoupled: true }")
        self.model_name = args["model_name"]
        # args["model_repository"] is this model's folder; model.json sits in the version's.
        model_json = read_model_json(Path(args["model_repository"]) / str(args["model_version"]))
        # A test model's failure switches (engine/faults.py); never engine arguments.
        faults, params = take_fault_parameters(triton_io.model_parameters(config))
        engine_config, self.options = split_parameters(
            params, model_json,
            log=lambda line: triton_io.log_info(f"{self.model_name}: {line}"))
        engine_config = place_instance(engine_config, args)
        self.input_names = triton_io.input_names(config)
        from engine import LLMEngine  # heavy (torch); after the cheap checks

        started = time.monotonic()
        metrics = (TritonMetrics(self.model_name, args["model_version"],
                                 engine_config.data_parallel_rank)
                   if self.options.report_custom_metrics else NullMetrics())
        self._worker = ResponseWorker(metrics)
        try:
            self._loop = EngineLoop(lambda: LLMEngine(engine_config, faults=faults), self._worker,
                                    collect_metrics=self.options.report_custom_metrics,
                                    max_queue_len=self.options.max_queue_len,
                                    fail_at_step=faults.loop_step,
                                    on_death=self._on_engine_death)
        except BaseException:
            self._worker.stop()
            raise
        self.engine = self._loop.engine
        self.tokenizer = self.engine.tokenizer
        cache = self.engine.config.cache
        # Through the sender thread, which owns every call into Triton once it runs.
        max_model_len = self.engine.config.scheduler.max_model_len
        self._worker.call(lambda: metrics.engine_ready(cache.block_size, cache.num_kv_blocks,
                                                       max_model_len))
        self._ids = itertools.count()
        triton_io.log_info(f"{self.model_name}: engine ready in {time.monotonic() - started:.1f} s "
                           f"({engine_config.model or 'embedded SmolLM2-135M-Instruct'})")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            # Before parsing: an overloaded or dead model answers at once, for free.
            refusal = self._loop.refusal()
            if refusal is not None:
                triton_io.send_error(sender, refusal, triton_io.UNAVAILABLE)
                continue
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
        """Read and check one Triton request, on Triton's execute thread, and return what
        the engine loop needs: the prompt (the `llm` model tokenizes it here), the sampling
        parameters, the response builder and the priority; `sender` and `arrival` (a
        time.monotonic() stamp) are carried along. Nothing reaches the engine here: the
        caller submits the result. InvalidRequest, or any other exception, makes the caller
        send one FINAL INVALID_ARG response and skip the request."""
        raise NotImplementedError

    def _on_engine_death(self, reason: str) -> None:
        """Runs on the dying engine thread, after its requests were answered."""
        if not self.options.enable_health_check:
            triton_io.log_error(f"{self.model_name}: engine stopped ({reason}); the model stays loaded "
                                "and answers UNAVAILABLE. With ENABLE_VLLM_HEALTH_CHECK=true (and "
                                "--model-control-mode=explicit) it unloads itself instead.")
            return
        # As vllm_backend's health check: unload, so /v2/models/<name>/ready says no. From
        # the sender thread, which owns the calls into Triton.
        self._worker.call(self._unload_self)

    def _unload_self(self) -> None:
        triton_io.log_error(f"{self.model_name}: engine unhealthy; unloading the model")
        try:
            triton_io.unload_model(self.model_name)
        except Exception as exc:  # noqa: BLE001 - e.g. not in explicit model control mode
            triton_io.log_error(f"{self.model_name}: engine unhealthy, but unloading failed: {exc} "
                                "(ENABLE_VLLM_HEALTH_CHECK needs --model-control-mode=explicit)")

    def finalize(self) -> None:
        # The engine thread closes the engine (tensor-parallel workers, KV-event sockets)
        # as its loop ends.
        self._loop.stop(self.options.drain_timeout_s)
        self._worker.stop()
