"""Per-sample norms and clipping, one topic: ``norm_fidelity`` (the norms a target clips with are the
true ones), ``clipped_step`` (one noiseless DP step equals the reference's), ``sensitivity_bound``
(no sample contributes more than C); ``norm_hypotheses`` and ``param_shares`` name the cause of a
wrong norm (a layer type left out, a bias counted twice, one parameter's share off by a factor)."""
