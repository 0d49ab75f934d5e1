"""What a step holds in memory: the allocator's blocks live at a step's peak, from a CUDA snapshot (`snapshot`),
and the tensors a compiled step saves for its backward, traced on the CPU (`partition`)."""
