"""The adapters an engine has loaded, by lora_int_id, at most max_cpu_loras of them: the
least recently used is dropped past that and loaded again from its folder when a request
needs it. `stage` reads an adapter's files on the caller's thread (the backend's request
thread) so that the engine thread, which builds the tensors, does not wait on the disk."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from engine.lora.adapter import AdapterFiles, LoRAAdapter, read_adapter_files
from engine.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, load: Callable[[LoRARequest, AdapterFiles | None], LoRAAdapter],
                 capacity: int,
                 read: Callable[[LoRARequest], AdapterFiles] = read_adapter_files) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self._load = load
        self._read = read
        self.capacity = capacity
        # Read by stage() on other threads, taken by get() on the engine's; at most
        # `capacity` of them wait, the oldest dropped first.
        self._staged: OrderedDict[int, AdapterFiles] = OrderedDict()
        self._lock = threading.Lock()
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Every id seen, with the adapter it named: an id stays one adapter for the
        # engine's life (it keys the loaded weights; vLLM asks the same of callers).
        self._names: dict[int, tuple[str, str]] = {}
        self.num_loads = 0

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded now if it is not (raises LoRAAdapterError for a bad one)."""
        key = request.lora_int_id
        known = self._names.get(key)
        if known is not None and known != (request.lora_name, request.lora_path):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id {key} already "
                             f"names adapter {known[0]!r} at {known[1]}")
        adapter = self._adapters.get(key)
        if adapter is not None:
            self._adapters.move_to_end(key)
            return adapter
        with self._lock:
            files = self._staged.pop(key, None)
        adapter = self._load(request, files)
        self.num_loads += 1
        self._names[key] = (request.lora_name, request.lora_path)
        self._adapters[key] = adapter
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter

    def stage(self, request: LoRARequest) -> None:
        """Read a not-loaded adapter's files now, on this thread, for get() to build from.
        A read that fails stages nothing: get() then reads again and reports the error."""
        key = request.lora_int_id
        if key in self._adapters or key in self._staged:
            return
        try:
            files = self._read(request)
        except ValueError:
            return
        with self._lock:
            self._staged[key] = files
            while len(self._staged) > self.capacity:
                self._staged.popitem(last=False)

    def loaded_ids(self) -> list[int]:
        """Loaded adapter ids, least recently used first."""
        return list(self._adapters)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters
