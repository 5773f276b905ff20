"""Remote attention: the R-Part on a fleet of R-workers over gRPC (rworker/).

- connection.py: one R-worker's channel and Session stream, its pending calls and failure
- fleet.py:      the workers in groups of head_shards, connected and kept healthy
- placement.py:  which group holds each sequence (open, close, loss when a worker goes down)
- messages.py:   tensors as they travel, calls split into messages of bounded size
- gather.py:     one decode call's replies assembled into its output
- backend.py:    RemoteAttention, the AttentionBackend the engine sees
"""
