"""Pure analyses that both sides read: the measuring side (`medddpm.measure`) and the book's (`medddpm.report`).
No torch, no files: functions of names, tables and published figures. `ncu_names` tells which of torch.profiler's
kernels an Nsight Compute kernel is; `roofs` gives a card's roofs, measured or from its datasheet."""
