"""Training under a configuration: the engine that runs one step (`engine`), the data sets (`data`), the
training loop with checkpoints and resume (`loop`) and its process group over ranks (`distributed`), step
timing and profiling (`timing`, `profiling`: the one loop and the one profiler pass every measurement and the
book's exercises run steps under), and sampling to NIfTI files (`sampling`)."""
