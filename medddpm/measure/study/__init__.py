"""The convergence study: configurations trained from the same seeds, weights, data and noise, sampled and scored
(`convergence`), with the scores of a generated volume (`sample_metrics`)."""
