"""The diffulex model's Triton side: engine construction, request hand-off, and Triton response senders.

model.py delegates here. `pb_utils` is the `triton_python_backend_utils` module, passed in because it
exists only inside the Python backend's stub process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import Diffulex, StepOutput
from ..sampling import SamplingParams
from .engine_loop import EngineLoop, LoopState
from .engine_settings import engine_settings, on_instance_device
from .metrics import ServingMetrics
from .request_parsing import INPUT_NAMES, ParsedRequest, parse_request
from .response_building import ResponseAssembler
from .server_watch import HttpLeaveProbe, ServerWatch, explicit_model_control, http_endpoint, parent_server_args
from .streams import ErrorKind, FailureCause
from .stub_watchdog import CLEAN, RELOAD, RELOAD_AT_START

# Where compiled Triton kernels are kept between loads, unless TRITON_CACHE_DIR says otherwise.
KERNEL_CACHE_DIR = Path.home() / ".cache" / "diffulex-triton" / "triton"


class TritonResponseStream:
    """One request's response sender, as the engine loop's ResponseStream."""

    def __init__(self, pb_utils, sender, assembler: ResponseAssembler):
        self._pb_utils = pb_utils
        self._sender = sender
        self._assembler = assembler

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()

    def send_output(self, output: StepOutput) -> None:
        arrays = self._assembler.add(output)
        if arrays is not None:
            pb_utils = self._pb_utils
            tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
            self._sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def send_error(self, kind: ErrorKind, message: str) -> None:
        send_error(self._pb_utils, self._sender, kind, message)


def send_error(pb_utils, sender, kind: ErrorKind, message: str) -> None:
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, kind.name))
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonLogHandler(logging.Handler):
    """The engine's log records (loading, warm-up, failures) into Triton's log, at the matching level, so that
    `--log-info=false` and `--log-warning=false` turn them off like the server's own lines."""

    def __init__(self, pb_utils, prefix: str):
        super().__init__(logging.INFO)
        self._logger = pb_utils.Logger
        self._prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{self._prefix}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                self._logger.log_error(text)
            elif record.levelno >= logging.WARNING:
                self._logger.log_warn(text)
            else:
                self._logger.log_info(text)
        except Exception:  # logging must never break what it reports on
            self.handleError(record)


class TritonAdapter:
    def __init__(self, pb_utils, args: dict):
        """`args` is what Triton passes to `initialize`. A bad setting or checkpoint raises, which fails the
        load with the engine's message."""
        self._pb_utils = pb_utils
        self._model_name = args["model_name"]
        self._log_handler = TritonLogHandler(pb_utils, self._model_name)
        package_logger = logging.getLogger("diffulex_backend")
        package_logger.addHandler(self._log_handler)
        package_logger.setLevel(logging.INFO)
        parameters = json.loads(args["model_config"]).get("parameters", {})
        settings = on_instance_device(engine_settings(parameters, model_dir=args["model_repository"]),
                                      args["model_instance_kind"], int(args["model_instance_device_id"]))
        if settings.get("device", "").startswith("cuda:") and torch.cuda.is_available():
            # This process hosts one engine: its GPU becomes the current device, where loading, warm-up and graph
            # captures allocate, rather than the first GPU.
            torch.cuda.set_device(torch.device(settings["device"]))
        started = time.monotonic()
        # Compiled kernels outlive the process, so only the first load on a machine compiles them.
        os.environ.setdefault("TRITON_CACHE_DIR", str(KERNEL_CACHE_DIR))
        # Ready only once warm (the engine warms itself): the first requests would otherwise wait for kernel
        # compiles and graph captures.
        self._engine = Diffulex(settings.pop("model"), **settings)
        report = self._engine.warm_up_report
        loaded = time.monotonic() - report.seconds
        self._engine.tokenizer.encode("warm")  # settles the tokenizer's state before two threads share it
        # One series per model instance: each instance is a process with an engine of its own. Triton names the
        # instances of one KIND_GPU group alike on every GPU it lists, so the device tells those apart.
        self._metrics = metrics = ServingMetrics(pb_utils.MetricFamily, {
            "model": self._model_name, "version": args["model_version"],
            "model_instance": args["model_instance_name"], "device": str(self._engine.device)},
            refusal_fields=(*INPUT_NAMES, *SamplingParams.field_names(), "prompt", "unknown"),
            settings=self._engine.resolved_settings())
        self._passes_at_ready = self._engine.num_forward_passes
        server_args = parent_server_args(os.getppid())
        endpoint = http_endpoint(server_args)
        # The watchdog reloads the model through the repository API, which explicit model control alone offers.
        self._reloads = endpoint is not None and explicit_model_control(server_args)
        self._watchdog = self._start_watchdog(endpoint if self._reloads else None)
        watch = ServerWatch(lambda: pb_utils.is_model_ready(self._model_name),
                            HttpLeaveProbe(*endpoint) if endpoint else None)
        try:
            self._loop = EngineLoop(self._engine, metrics, on_failure=self._take_out_of_service,
                                    server_is_leaving=watch.server_is_leaving)
        except BaseException:  # the load fails with the cause; the watchdog must not reload what never loaded
            self._tell_watchdog(CLEAN)
            raise
        pb_utils.Logger.log_info(
            f"{self._model_name}: engine ready in {time.monotonic() - started:.1f} s (load {loaded - started:.1f} s, "
            f"warm-up {report.seconds:.1f} s over batch sizes {list(report.batch_sizes)}; kernel cache "
            f"{os.environ['TRITON_CACHE_DIR']}) with {self._engine.config}")

    def execute(self, requests) -> None:
        """Parse, tokenize and check each request here, on Triton's thread, and hand it to the engine loop. Each
        request is handled on its own: whatever one raises ends that request alone, with its reason."""
        for request in requests:
            sender = None
            try:
                sender = request.get_response_sender()
                parsed = parse_request(self._read_inputs(request), request.parameters())
                prepared = self._engine.prepare_request(parsed.prompt, parsed.params)
            except ValueError as err:  # a Refusal, or a prompt the engine can never serve
                field = getattr(err, "field", "other")
                self._metrics.count_refusal(field)
                self._pb_utils.Logger.log_info(f"{self._model_name}: refused a request ({field}): {_bounded(str(err))}")
                self._refuse(sender, ErrorKind.INVALID_ARG, str(err))
                continue
            except Exception as err:  # a fault of ours, not the client's; still this request's alone
                self._pb_utils.Logger.log_error(f"{self._model_name}: preparing a request failed: {err!r}")
                self._metrics.count_errors("internal")
                self._refuse(sender, ErrorKind.INTERNAL, f"preparing the request failed: {type(err).__name__}: {err}")
                continue
            assembler = ResponseAssembler(parsed, self._prompt_text(parsed))
            self._loop.submit(prepared, TritonResponseStream(self._pb_utils, sender, assembler))

    def _read_inputs(self, request) -> dict:
        inputs = {}
        for name in INPUT_NAMES:
            tensor = self._pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return inputs

    def _refuse(self, sender, kind: ErrorKind, message: str) -> None:
        if sender is None:
            return  # no sender: Triton ends the request itself
        try:
            send_error(self._pb_utils, sender, kind, _bounded(message))
        except Exception as err:  # the client may be gone
            self._pb_utils.Logger.log_warn(f"{self._model_name}: sending an error response failed: {err!r}")

    def is_ready(self) -> bool:
        return self._loop.state is LoopState.RUNNING

    def finalize(self) -> None:
        self._tell_watchdog(CLEAN)
        self._loop.stop()
        self._engine.close()  # the tensor-parallel ranks' processes, if any
        logging.getLogger("diffulex_backend").removeHandler(self._log_handler)
        del self._loop, self._engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _prompt_text(self, parsed: ParsedRequest):
        prompt = parsed.prompt
        if isinstance(prompt, str):
            return lambda: prompt
        return lambda: self._engine.tokenizer.decode(prompt)

    def _start_watchdog(self, endpoint: tuple[str, int] | None) -> subprocess.Popen | None:
        """The child that watches this stub (stub_watchdog.py): it reloads the model if the stub dies, given the
        server's endpoint, and ends the stub if the server dies under it. Its own session, so that a signal to the
        server's process group reaches the server alone."""
        python = sys.executable if Path(sys.executable).name.startswith("python") else "python3"
        reload_args = [] if endpoint is None else ["--host", endpoint[0], "--port", str(endpoint[1])]
        try:
            return subprocess.Popen(
                # The file, not the module: importing the package would load torch into the watchdog.
                [python, str(Path(__file__).with_name("stub_watchdog.py")), "--stub-pid", str(os.getpid()),
                 "--server-pid", str(os.getppid()), "--model", self._model_name, *reload_args],
                stdin=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as err:
            self._pb_utils.Logger.log_warn(f"{self._model_name}: no stub watchdog: {err}")
            return None

    def _tell_watchdog(self, word: bytes) -> None:
        if self._watchdog is not None:
            try:
                self._watchdog.stdin.write(word + b"\n")
                self._watchdog.stdin.close()
            except OSError:
                pass
            self._watchdog = None

    def _take_out_of_service(self, cause: FailureCause, message: str) -> None:
        """After an engine failure or the end of one of the loop's threads, which no request caused (each request is
        checked before it joins a step): open requests have ended with INTERNAL, and new ones get UNAVAILABLE. The
        watchdog reloads the model, which gives it a fresh process and engine, unless it keeps failing before its
        first step (stub_watchdog.py); where nothing can reload it (a server not under explicit model control) the
        model keeps refusing until it is loaded again. Triton 2.51 never asks `is_ready`, so the unload is what turns
        the model not ready."""
        pb_utils = self._pb_utils
        pb_utils.Logger.log_error(f"{self._model_name}: {cause.value}: {message}")
        if not self._reloads or self._watchdog is None:
            why = "the server is not under --model-control-mode=explicit" if not self._reloads else "no watchdog"
            pb_utils.Logger.log_error(f"{self._model_name}: nothing can reload the model ({why}): it refuses "
                                      "requests until it is loaded again")
        served_a_step = self._engine.num_forward_passes > self._passes_at_ready
        self._tell_watchdog(RELOAD if served_a_step else RELOAD_AT_START)

MAX_ERROR_CHARS = 2000


def _bounded(message: str) -> str:
    """An error message cut to a size a client can take: some quote what the client sent."""
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ... (cut)"
