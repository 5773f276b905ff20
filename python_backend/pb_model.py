"""The only module that touches triton_python_backend_utils: wires EngineHost into Triton.

model_repository/fastdecode/1/model.py is `from python_backend.pb_model import FastDecodeModel
as TritonPythonModel`.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from python_backend.config import build_configs, model_parameters
from python_backend.errors import ErrorInfo
from python_backend.host import EngineHost, install_step_fault
from python_backend.metrics import Metrics

class PbTransport:
    def __init__(self, model_name: str):
        self.model_name = model_name

    def send(self, sender, outputs, error: ErrorInfo | None, final: bool) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        tensors = [pb_utils.Tensor(name, np.ascontiguousarray(array)) for name, array in (outputs or {}).items()]
        if error is not None:
            code = getattr(pb_utils.TritonError, error.code, pb_utils.TritonError.INTERNAL)
            response = pb_utils.InferenceResponse(output_tensors=tensors, error=pb_utils.TritonError(error.message, code))
        elif tensors:
            response = pb_utils.InferenceResponse(output_tensors=tensors)
        else:
            sender.send(flags=flags)
            return
        sender.send(response, flags=flags)

    def is_cancelled(self, sender) -> bool:
        return sender.is_cancelled()

    def unload(self) -> None:
        pb_utils.unload_model(self.model_name)       # asynchronous; needs --model-control-mode=explicit

    def log(self, level: str, message: str) -> None:
        logger = pb_utils.Logger
        {"error": logger.log_error, "warn": logger.log_warn}.get(level, logger.log_info)(message)


class PbMetricsSink:
    """pb_utils metrics; the families must outlive their metrics, so they are kept here."""

    def __init__(self):
        self.families: dict[str, object] = {}

    def _family(self, name: str, description: str, kind):
        if name not in self.families:
            self.families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        return self.families[name]

    def counter(self, name, description, labels):
        return self._family(name, description, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)

    def gauge(self, name, description, labels):
        return self._family(name, description, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)

    def histogram(self, name, description, labels, buckets):
        return self._family(name, description, pb_utils.MetricFamily.HISTOGRAM).Metric(labels=labels, buckets=buckets)


class FastDecodeModel:
    """Decoupled S-worker model: text in, streamed text out (vLLM backend tensor contract)."""

    def initialize(self, args):
        from fastdecode.engine import Engine

        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the fastdecode model must be decoupled "
                                                "(model_transaction_policy { decoupled: True })")
        name = args["model_name"]
        engine_config, options = build_configs(model_parameters(model_config))
        shown = engine_config.replace(rworker_token="***") if engine_config.rworker_token else engine_config
        pb_utils.Logger.log_info(f"fastdecode: starting engine: {shown}")
        self.engine = Engine(engine_config)
        pb_utils.Logger.log_info(f"fastdecode: engine on {self.engine.device}, torch threads {torch.get_num_threads()}, "
                                  f"dtype {self.engine.dtype} ({self.engine.dtype_choice['reason']})")
        if options.fault_step_error_file:
            install_step_fault(self.engine, options.fault_step_error_file)
        self.metrics_sink = PbMetricsSink()
        metrics = Metrics(self.metrics_sink, {"model": name, "version": args["model_version"]})
        self.host = EngineHost(self.engine, PbTransport(name), metrics, cancel_poll_s=options.cancel_poll_s,
                               metrics_interval_s=options.metrics_interval_s, send_threads=options.send_threads,
                               stream_interval=options.stream_interval, max_hold_s=options.max_hold_s)
        self.engine.start()

    def execute(self, requests):
        for request in requests:
            self.host.submit(request.get_response_sender(), _input_getter(request), request.parameters())
        return None

    def finalize(self):
        pb_utils.Logger.log_info("fastdecode: finalize: stopping the engine")
        self.host.shutdown()
        pb_utils.Logger.log_info("fastdecode: finalize: done")
        self.host.metrics = None


def _input_getter(request):
    def get(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get
