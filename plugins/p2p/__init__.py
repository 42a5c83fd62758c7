"""P2pNcclConnector: prefill/decode hand-off: P pushes (PUT, PUT_ASYNC) or D pulls (GET) KV
between workers; ZMQ control, NCCL data on CUDA, ZMQ frames on CPU.

vLLM's legacy P2P NCCL design.
"""
