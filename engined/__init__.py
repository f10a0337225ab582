"""engined: a GPU-free stand-in for a vLLM inference engine."""

__version__ = "0.1.0"
