"""Training under a configuration: the engine that runs one step (`engine`), the data sets (`data`), the
training loop with checkpoints and resume (`loop`), and sampling to NIfTI files (`sampling`)."""
