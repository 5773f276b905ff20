"""OpenAI-compatible HTTP server in front of a fastdecode Triton deployment.

    python -m openai_frontend --triton-url 127.0.0.1:8001 --model-dir DIR [--model fastdecode]
                              [--host 127.0.0.1] [--port 9000] [--served-model-name NAME]

Speaks /v1/models, /v1/completions and /v1/chat/completions (streamed as server-sent events) and
forwards each choice as one streamed gRPC request to Triton (the vLLM-backend tensor contract).
"""
