"""Pure analyses that both sides read: the measuring side (`medddpm.measure`) and the book's (`medddpm.report`).
No torch at import and no measuring: functions of names, traces, tables and published figures. `kernels` makes the
kernel table of a torch.profiler trace (categories, readable names); `ncu_names` tells which of torch.profiler's
kernels an Nsight Compute kernel is; `ncu_table` reads ncu's export into one long table and derives the per-launch
summary, the rules' priorities and the share of the step the counters cover; `layers` compares one layer kernel
against kernel across configurations and weights counters by the step (its `layer_counts` counts a run's layers
on the model, loading torch when called); `roofs` gives a card's roofs, measured or from its datasheet; `levers`
ranks a step's kernels by their distance from the roof that binds them, and decides a lever from interleaved
repeats."""
