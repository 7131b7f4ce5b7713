"""The whole-run release judge, one topic in one package: ``analysis`` decomposes every noisy
release into the reference's clipped sum and noise and tests it (pure functions returning
findings), ``wording`` makes the sentences, ``judge`` keeps the run's ledger and turns findings into
``noise_calibration`` verdicts. ``analysis`` never imports ``wording``."""
