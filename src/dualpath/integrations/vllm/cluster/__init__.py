"""`dualpath vllm up`: P/D vLLM servers with the connector on one machine (or emulated hosts)."""
