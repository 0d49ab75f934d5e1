"""How long things take: a training micro-step or a denoising step per configuration and the `bench` table
(`bench`), the same step fed by the data loader (`end_to_end`), the clocks and throttling while steps are timed
(`clocks`), the public reference's step (`reference`), and a card's bandwidth and matmul rates (`roofs`). Every
step is timed by `medddpm.train.timing`, with no profiler attached."""
