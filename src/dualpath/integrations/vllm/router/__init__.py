"""`dualpath route`: DualPath's global scheduler in front of vLLM prefill and decode servers."""
