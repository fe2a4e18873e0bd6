"""The planner: what DualPath would do on a given cluster, model and trace, from simulator runs.

`advise` sweeps P/D and modes for the best SLO capacity per GPU (`capacity` holds the online
SLO search); `deploy` turns a recommendation into per-host vLLM and router commands;
`step_profile` is the profile file format (one engine's measured step costs); `setups` names
clusters; `runner` runs and caches simulations (in processes or on Ray, `ray_backend`);
`section` is what a study gets (`Context`) and returns (`Section`). Nothing here imports
`dualpath.reproduce`, which builds the paper's report on top of it.
"""
