"""Sampling, one topic: ``check`` is ``sampling_accounting`` (the sampler is the Poisson sampling the
accountant assumes: rate q, independent across ranks and steps, the same steps on every rank)."""
