"""Training under a configuration: the engine that runs one step (`engine`), the data sets (`data`), the
training loop with checkpoints and resume (`loop`), step timing (`timing`: the one loop every
measurement times steps with), and sampling to NIfTI files (`sampling`)."""
