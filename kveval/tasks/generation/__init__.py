"""The generation task: the model's own long generations through the real quantized cache, against the
full-precision model's (divergence, KLD along the trajectory, degenerate decoding, task accuracy and pass@k)."""
