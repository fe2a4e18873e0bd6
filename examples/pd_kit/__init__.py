"""What the vLLM examples share (none of the scripts imports another): the chat they hold
(`prompts`), a `dualpath route` process over a cluster (`router`) and the kill test's phase
(`failover`). The scripts beside this package import it from their own folder."""
