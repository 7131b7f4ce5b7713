"""The configuration of a run, torch-free: the defaults the CLI states (``defaults``), the
configuration space with its typed axes, combination rules and seeds by name (``space``), the mode
labels and their environments (``modes``), and the hypothesis profiles (``hypothesis_profiles``).

Everything here is importable without torch, so the planning path (``run --dry-run``, usage errors)
answers before torch or a target is imported.
"""
