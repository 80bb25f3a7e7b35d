"""What a request is made of: sampling settings and prompts. A leaf: it imports no other
samebits module, so the engine, the model families and the trainer can all read it."""

from samebits.requests.prompts import MultimodalPrompt, as_multimodal
from samebits.requests.sampling_params import FusedLine, SamplingParams

__all__ = ["FusedLine", "MultimodalPrompt", "SamplingParams", "as_multimodal"]
