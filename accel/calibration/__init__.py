"""Measured costs: the verify-cost table per (model, device, dtype, threads)
(:mod:`.calibrate`), the cost model that sizes drafts and chooses kernels from it
(:mod:`.cost_model`), and the timed passes that fill it (:mod:`.timing`)."""
