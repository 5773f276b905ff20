"""The S-Part: Llama-family model in torch, checkpoint loading, default-model conversion."""
from fastdecode.model.llama import LlamaModel, ModelArgs
from fastdecode.model.loader import LoadedModel, load_model

__all__ = ["LlamaModel", "ModelArgs", "LoadedModel", "load_model"]
