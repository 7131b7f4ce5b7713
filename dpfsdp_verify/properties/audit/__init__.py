"""The empirical privacy audit, one topic: ``check`` is ``privacy_audit`` (secret canaries through the
target's own training; the epsilon they prove never exceeds the accountant's); ``bound`` the
counting bound (Steinke, Nasr, Jagielski), ``fdp`` the f-DP one-run bound (Mahloujifar et al.)."""
