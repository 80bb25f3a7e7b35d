"""Weights from another process. SGLang's protocol: the trainer's process group (`group`), CUDA
IPC handles (`ipc`), the engine's receiving side (`receiver`); the trainer's side is
`samebits.client`. vLLM's NCCL weight transfer (TRL's VLLMClient): its wire format
(`vllm_transfer`), a ctypes libnccl binding (`nccl`), the engine's receiving side
(`vllm_receiver`)."""
