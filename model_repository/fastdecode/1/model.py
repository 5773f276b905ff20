"""The fastdecode S-worker model: all logic lives in python_backend (tested without Triton)."""
from python_backend.pb_model import FastDecodeModel as TritonPythonModel  # noqa: F401
