"""Reproduction of the paper's experiments with the simulator: configs -> runs -> CSV, PNG, report.

`paper` holds the paper's published numbers (Fig. 7 values read off the figure, Table 2, and the
textual claims of §7); `plots` draws labelled figures with the paper's values marked; `registry`
runs experiments and `report` assembles the report (`docs/reproduction/README.md`). It builds on
`dualpath.plan` (setups, the runner, the online SLO search); the planner never imports it.
"""
