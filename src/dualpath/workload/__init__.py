"""Agent workloads: trajectories, the Table 2 generator, replay rules, Mooncake traces, token ids.

API summary (all lengths in tokens; see each module for the exact rules):

- `trajectory`: `Trajectory(append_tokens, gen_tokens, trajectory_id)` with `num_turns`,
  `total_tokens`, `context_tokens()`, `prompt_tokens()`, `hit_tokens(block_size)`, `turns()`;
  `TurnTable.from_trajectories(trajs, block_size)`: every turn as flat numpy arrays
  (`append_tokens`, `gen_tokens`, `context_tokens`, `prompt_tokens`, `hit_tokens`,
  `trajectory_index`, `turn_index`, `starts`) for the simulator.
- `jsonl`: the versioned trajectory JSONL format; `load_trajectories(path) -> TrajectoryFile`
  (strict, all or nothing, errors name file:line and field), `save_trajectories(path, tf)`.
- `synthetic`: `TABLE2`, `PRESETS` ("32k", "48k", "64k"), `preset(name)`,
  `generate(params, seed) -> list[Trajectory]`, `generate_table(params, seed) -> TurnTable`.
- `stats`: `table2_stats(table) -> Table2Stats` (Table 2 columns and the hit rate).
- `replay`: `truncate_at(traj, max_len_tokens)`, `scale_lengths(traj, append_factor,
  gen_factor, max_len_tokens)`, `expand_agents(trajs, num_agents, seed) -> list[Agent]`.
"""
