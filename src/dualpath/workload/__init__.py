"""Agent workloads: trajectories, the Table 2 generator, replay rules, Mooncake traces, token ids.

API summary (all lengths in tokens; each module's docstring states its exact rules):

- `trajectory`: `Trajectory(append_tokens, gen_tokens, trajectory_id)` with `num_turns`,
  `total_tokens`, `context_tokens()`, `prompt_tokens()`, `hit_tokens(block_size=64)`, `turns()`
  (list of `Turn`); hit = floor(context / block_size) * block_size, within the trajectory only.
  `TurnTable.from_trajectories(trajs, block_size)`: every turn as flat int64 numpy arrays
  (`append_tokens`, `gen_tokens`, `context_tokens`, `prompt_tokens`, `hit_tokens`,
  `trajectory_index`, `turn_index`, `starts`, `turns_per_trajectory`, `total_tokens`).
- `jsonl`: the versioned trajectory JSONL format (v1). `load_trajectories(path) ->
  TrajectoryFile` (strict, all or nothing; `TraceFormatError` names file:line and field),
  `save_trajectories(path, tf)`, `trajectory_file(trajs, max_len_tokens, block_size, meta)`.
- `synthetic`: `TABLE2` (paper rows), `PRESETS` / `preset("32k" | "48k" | "64k")`,
  `generate(params, seed) -> list[Trajectory]`, `generate_table(params, seed) -> TurnTable`.
- `fit`: `fit_params(Table2Row(...)) -> SyntheticParams` for your own Table 2 row.
- `stats`: `table2_stats(table) -> Table2Stats` (Table 2 columns, pooled hit rate,
  `paper_hit_rate` = 1 - Append/Context).
- `replay`: `truncate_at(traj, max_len_tokens)`, `scale_lengths(traj, append_factor,
  gen_factor, max_len_tokens)`, `expand_agents(trajs, num_agents, seed) -> list[Agent]`.
- `mooncake`: `load_mooncake(path) -> MooncakeTrace` (requests in timestamp order; arrays
  `timestamp_s`, `input_tokens`, `output_tokens`, `hit_blocks`, `hit_tokens` against an unbounded
  prefix store; `block_reuse_rate`), `to_trajectories(trace) -> TrajectoryFile`.
- `tokens`: `RandomTokens(vocab_size, seed).append_ids(agent, turn, n)`, `TextTokens`,
  `prompt_ids(source, agent, traj, turn, generated)`: deterministic prompt token ids.
"""
