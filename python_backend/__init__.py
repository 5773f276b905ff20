"""Triton adapters shared by the model.py files of model_repository/.

Everything here but `pb_model.py` is plain Python, importable and tested without Triton
(tests/test_python_backend*.py):

    request.py   Triton inputs (Triton vLLM backend contract) -> GenerateRequest
    response.py  engine RequestOutput -> output tensors (text deltas, finish reason, token counts)
    errors.py    exceptions -> (message, Triton error code)
    metrics.py   token counters, TTFT/TPOT histograms, running/waiting/KV gauges
    config.py    model parameters (config.pbtxt) -> EngineConfig
    host.py      EngineHost: the engine's background loop, the request table, streaming,
                 cancellation, the crash watchdog
    pb_model.py  the thin layer over triton_python_backend_utils (only file that imports it)
"""
