"""R-worker: the R-Part (KV-cache + attention) of FastDecode as a gRPC service on CPU nodes.

`python -m rworker` serves; fastdecode.attention.remote is its client.
"""
