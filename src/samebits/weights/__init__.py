"""Weights from another process: the trainer's process group (`group`), CUDA IPC handles
(`ipc`), the engine's receiving side (`receiver`); the trainer's side is `samebits.client`."""
