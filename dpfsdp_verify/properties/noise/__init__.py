"""The noise, one topic: ``check`` is ``noise_calibration`` (Gaussian noise of std sigma*C/D on every
coordinate, never repeated, never correlated); ``stats`` its statistics, ``exact`` its exact checks
(repeats, unnoised rounds), ``repeats`` the sentences of a repeat. The whole-run release judge it
shares is ``properties/releases``."""
