"""Runs over several steps and loop shapes, one topic: ``trajectory`` (K steps under FSDP equal K
steps on one process), ``mode_equivalence`` (two modes, or a step unsplit vs accumulated, give the
same run), ``checkpoint_resume`` (a resumed run continues the same trajectory, never replaying
noise or masks)."""
