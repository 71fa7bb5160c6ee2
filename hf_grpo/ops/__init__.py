"""Memory-bounded tensor ops shared by the trainers."""

from .logprobs import chunked_logprobs

__all__ = ["chunked_logprobs"]
