"""The `stream_ceiling` model (see ../config.pbtxt): Triton's streaming path with no
engine behind it. execute() only registers each request; one thread sends, in rounds
over the open requests like the engine loop's steps, a one-token response to each, the
last one FINAL. The responses carry what `llm`'s do at stream_interval 1 with
return_num_output_tokens: one short text_output and num_output_tokens [1]."""
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._cond = threading.Condition()
        self._new = []  # (sender, tokens to send), guarded by _cond
        self._stopping = False
        self._text = np.array([b" x"], dtype=np.object_)
        self._one = np.array([1], dtype=np.uint32)
        self._thread = threading.Thread(target=self._send_loop, daemon=True)
        self._thread.start()

    def execute(self, requests):
        with self._cond:
            for request in requests:
                params = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
                sampling = json.loads(params.as_numpy()[0]) if params is not None else {}
                self._new.append([request.get_response_sender(), int(sampling.get("max_tokens", 16))])
            self._cond.notify()
        return None

    def _send_loop(self):
        open_requests = []
        while True:
            with self._cond:
                while not self._new and not open_requests and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                open_requests += self._new
                self._new = []
            still_open = []
            for entry in open_requests:  # one "step": a response to each open request
                sender, left = entry
                response = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", self._text),
                    pb_utils.Tensor("num_output_tokens", self._one)])
                final = left == 1
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                if not final:
                    entry[1] = left - 1
                    still_open.append(entry)
            open_requests = still_open

    def finalize(self):
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
