"""The gate, ``dpfsdp-verify``: a CI verdict on an opacus fork, one module per stage.

``cli`` parses the command line; ``plan`` validates everything once into a ``RunPlan`` (one
``properties.Options`` plus the gate's own fields: properties, fuzzing, expectations, reports);
``run`` runs a plan property by property on one warm pool; ``report`` renders every report and
computes the exit code; ``target_info`` says which target and opacus were checked;
``expectations`` reads ``--expect`` files (known failures of a target) and judges verdicts
against them. Data flows down: cli -> plan -> run -> report.
"""

__all__: list = []  # the stages are its modules (above); the package itself exports nothing
