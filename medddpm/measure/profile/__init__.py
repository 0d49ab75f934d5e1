"""Where a step's time goes on the hardware: Nsight Compute's counters for the kernels that make up most of a
step (`ncu`), the layer range of each profiled launch (`ncu_layers`), the program ncu profiles (`capture`) and
counters added to a run already measured (`counters`). torch.profiler's kernel table comes from
`medddpm.train.profiling`, its analyses from `medddpm.analysis`."""
