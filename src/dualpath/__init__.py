"""DualPath: dual-path KV-cache loading for agentic LLM inference (arXiv 2602.21548)."""

__version__ = "0.1.0"
