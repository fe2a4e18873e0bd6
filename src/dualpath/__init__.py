"""DualPath: dual-path KV-cache loading for agentic LLM inference (arXiv 2602.21548)."""

from dualpath._compiled import install as _install_compiled

__version__ = "0.2.0"

# Compiled (mypyc) simulator modules are used only when built from the current sources.
IMPLEMENTATION = _install_compiled()

