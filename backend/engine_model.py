"""Shared TritonPythonModel skeleton for the decoupled models that own an engine
(`llm`: text in/out, `tensorrt_llm`: token ids in/out).

Engine arguments come from the version folder's model.json (vllm_backend's file) and
the config.pbtxt parameters, which win (backend/config_params.py)."""
from __future__ import annotations

import ctypes
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
from backend.lora_catalog import LoRACatalog
from backend.model_json import read_model_json
from backend.multi_lora import read_multi_lora, resolve_lora_name
from backend.request_parsing import InvalidRequest
from backend.response_worker import ResponseWorker
from engine.api import take_fault_parameters


class EngineModel:
    """The Triton side of an engine model; subclasses implement `make_inflight`."""

    def initialize(self, args: dict[str, Any]) -> None:
        config = triton_io.parse_model_config(args)
        if not config.get("model_transaction_policy", {}).get("decoupled", False):
            raise ValueError(f"model {args['model_name']!r} must set model_transaction_policy "
                             "{ decoupled: true }")
        self.model_name = args["model_name"]
        # args["model_repository"] is this model's folder; model.json sits in the version's.
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        model_json = read_model_json(version_dir)
        # A test model's failure switches (engine/faults.py); never engine arguments.
        faults, params = take_fault_parameters(triton_io.model_parameters(config))
        engine_config, self.options = split_parameters(
            params, model_json,
            log=lambda line: triton_io.log_info(f"{self.model_name}: {line}"))
        engine_config = place_instance(engine_config, args)
        # As vllm_backend: enable_lora needs multi_lora.json (adapter name -> folder).
        if self.options.lora_modules and not engine_config.lora.enable_lora:
            raise ValueError("parameter 'lora_modules' needs enable_lora=true")
        runtime = self.options.allow_runtime_lora_updating
        # Adapters loaded at run time may be the only ones: multi_lora.json is optional then.
        self.lora_catalog = (LoRACatalog(read_multi_lora(version_dir, self.options.lora_modules,
                                                         required=not runtime), runtime)
                             if engine_config.lora.enable_lora else None)
        self.input_names = triton_io.input_names(config)
        from engine.api import LLMEngine  # heavy (torch); after the cheap checks

        started = time.monotonic()
        metrics = (TritonMetrics(self.model_name, args["model_version"],
                                 engine_config.data_parallel_rank)
                   if self.options.report_custom_metrics else NullMetrics())
        self._metrics = metrics
        self._worker = ResponseWorker(metrics)
        try:
            self._loop = EngineLoop(lambda: self._build_engine(LLMEngine, engine_config, faults),
                                    self._worker,
                                    collect_metrics=self.options.report_custom_metrics,
                                    max_queue_len=self.options.max_queue_len,
                                    fail_at_step=faults.loop_step,
                                    on_death=self._on_engine_death,
                                    request_deadline_s=self.options.request_deadline_s)
        except BaseException:
            self._worker.stop()
            raise
        self.engine = self._loop.engine
        self.tokenizer = self.engine.tokenizer
        cache = self.engine.config.cache
        # Through the sender thread, which owns every call into Triton once it runs.
        max_model_len = self.engine.config.scheduler.max_model_len
        lora = self.engine.config.lora
        speculative = self.engine.config.speculative_config
        self._worker.call(lambda: metrics.engine_ready(
            cache.block_size, cache.num_kv_blocks, max_model_len,
            max_loras=lora.max_loras if lora.enable_lora else None,
            num_speculative_tokens=None if speculative is None
            else speculative.num_speculative_tokens))
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
            if inflight is not None:  # None: make_inflight answered it already
                self._loop.submit(inflight)
        return None

    def _build_engine(self, engine_cls, config, faults):
        """On the engine thread. Every multi_lora.json adapter is loaded once, so a bad one
        fails the model load naming it (past max_cpu_loras the least recently used are
        dropped again and reloaded on demand)."""
        engine = engine_cls(config, faults=faults)
        try:
            configured = {} if self.lora_catalog is None else self.lora_catalog.configured
            for adapter in configured.values():
                engine.lora.adapter(adapter)
        except BaseException:
            engine.close()
            raise
        return engine

    def lora_request(self, lora_name: str, lora_path: str | None = None):
        """The adapter a request's lora_name (and lora_path, where the model allows
        runtime adapters) selects; InvalidRequest naming the field if none. An adapter not
        loaded (a new runtime one, or one dropped past max_cpu_loras) has its files read
        here, on Triton's thread, so the engine thread only builds its tensors; a bad
        folder is then refused by add_request, alone (INVALID_ARG naming the adapter)."""
        try:
            if self.lora_catalog is None:
                resolve_lora_name(None, lora_name)  # raises: LoRA is off on this model
            adapter = self.lora_catalog.resolve(lora_name, lora_path)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self.engine.lora.stage(adapter)
        return adapter

    def make_inflight(self, request: Any, request_id: str, sender: Any,
                      arrival: float) -> Inflight | None:
        """Read and check one Triton request, on Triton's execute thread, and return what
        the engine loop needs: the prompt (the `llm` model tokenizes it here), the sampling
        parameters, the response builder and the priority; `sender` and `arrival` (a
        time.monotonic() stamp) are carried along. Nothing reaches the engine here: the
        caller submits the result. None: a request that needs no engine, answered already
        (answer_now). InvalidRequest, or any other exception, makes the caller send one
        FINAL INVALID_ARG response and skip the request."""
        raise NotImplementedError

    def answer_now(self, sender: Any, tensors: dict[str, Any]) -> None:
        """One FINAL response with `tensors`, through the sender thread as every response."""
        self._worker.send(sender, tensors, final=True)

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
        # The Triton metric objects are never destroyed: a MetricFamily deleted at unload
        # takes its name's series off the server, the reloaded instance's included (a live
        # reload lost vllm:cache_config_info), and one destroyed in Py_FinalizeEx's last
        # collection, after the stub released its shared memory, segfaulted the stub
        # (Metric::SaveToSharedMemory; seen once xgrammar, through apache-tvm-ffi, had
        # changed the order of the stub's exit). One reference that is never dropped keeps
        # them, and everything they hold, out of both.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._metrics))
        # Everything else goes now, while the stub still runs: the stub keeps the model
        # object, and its engine loop's on_death refers back to it.
        self.__dict__.clear()
