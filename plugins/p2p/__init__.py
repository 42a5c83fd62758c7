"""P2pNcclConnector: prefill/decode KV hand-off between engine workers, ZMQ control plane,
NCCL data plane on CUDA and a ZMQ-frame data plane on CPU (vLLM's legacy P2P NCCL design)."""
