"""Measurement: bench timings of configurations (`bench`; steps are timed by `medddpm.train.timing`), one
measured run of the producer notebook (`run`), the sweep over configurations and its backends (`sweep`,
`cluster`), the profilers (`kernels`: torch.profiler; `ncu`, `capture`, `counters`, `layers`: Nsight Compute),
memory (`snapshot`, `partition`), data-parallel scaling (`scaling`, `distributed`), the reference
implementation (`reference`) and the machine (`env`). Nothing here reads the book's side (`medddpm.report`)."""
