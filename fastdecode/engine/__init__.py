"""The decode engine: continuous batching over the S-Part and an attention backend."""
from fastdecode.engine.engine import Engine
from fastdecode.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from fastdecode.engine.sampling import SamplingParams
from fastdecode.engine.sequence import RequestOutput

__all__ = ["Engine", "SamplingParams", "RequestOutput", "InvalidRequestError", "EngineOverloadedError",
           "EngineDeadError"]
