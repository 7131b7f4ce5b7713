"""The target contract: how the suite drives an implementation of DP training under FSDP.

A *target* is the implementation under test (upstream opacus, a fork, a specimen). The suite never
looks inside it; on every rank of a worker group (``torch.distributed`` initialised) it calls

    target.run(spec: RunSpec) -> RankOutput

and judges the outputs of all ranks against ``dpfsdp_verify.reference``. ``run`` must:

1. build the model ``models.build_model(spec.model, spec.model_seed, dtype, **dict(spec.model_kwargs))``
   on every rank and shard it the way the implementation does (FSDP2 ``fully_shard`` / ``FSDP2Wrapper``...);
2. for each step ``k`` take the global batch ``spec.global_batch(k)`` and feed this rank the
   samples ``spec.rank_indices(k, rank)`` (``split``: what a ``DistributedSampler`` over the
   global dataset gives, or the explicit per-rank split in ``spec.rank_batches``; ``replicated``:
   every sample on every rank), in that order;
3. take one DP step (clip with ``spec.max_grad_norm``, noise ``spec.noise_multiplier`` from a
   generator seeded with ``spec.noise_seed`` where the target supports one, loss reduction
   ``spec.reduction``, plain SGD with ``spec.lr``);
4. report, per step, a ``StepOutput``: the global indices of the samples it processed, the
   per-sample norms it *clipped with* (aligned with those indices), its loss, and the full
   (un-sharded) gradient after the DP step and parameters after the optimizer step, float64,
   keyed by the model's own parameter names (``fc1.weight``, no wrapper prefixes).

Sampling (``spec.sampling``): ``"fixed"`` (the default) is everything above. ``"poisson"`` is
DP-SGD's own sampling, run the way a user runs it: a dataset of ``spec.dataset_size`` samples
(``spec.dataset()``; step indices are *dataset* indices ``0..dataset_size-1``), each sample in
each step's batch independently with probability ``spec.sample_rate`` q, ``spec.epochs`` epochs
of ``int(1/q)`` steps (opacus' ``num_batches``), the random source seeded as ``spec.seeding``
says (``same``: ``torch.manual_seed(sampling_seed)`` on every rank; ``per_rank``:
``sampling_seed + rank``; ``unseeded``: ``torch.seed()``), at most ``spec.steps`` steps
(``steps=0``: every step of every epoch). The target reports the indices each step *really
drew* (read back from the data), and the normalisation under ``"mean"`` is
``spec.expected_batch_size`` (opacus: ``int(q * dataset_size)``), never the realised batch size.

Physical batches (gradient accumulation, ``spec.physical_batch_size`` p > 0; 0 = none): each
logical step above is computed in *physical passes* of at most p samples each (a forward and a
backward per pass, as a user with limited memory trains) and ends in ONE optimizer step: every
sample clipped on its own in its pass, the clipped gradients summed over the passes, noise added
once per logical step, the ``"mean"`` divisor the expected *logical* batch, never p. Poisson runs
use the target's own accumulation machinery as a user runs it (opacus:
``BatchMemoryManager(max_physical_batch_size=p)``); fixed batches take ``ceil(local / p)`` passes
(the same machinery where there is one). Under FSDP each pass joins collectives, so a correct
implementation keeps every rank at the same number of passes per step (e.g. agrees on the
maximum and pads with empty passes). A target reports each step's pass sizes in
``StepOutput.physical_batches`` and calls ``progress.pass_begun`` per pass; a target that cannot
accumulate leaves ``"physical_batches"`` out of ``Target.features`` and is told so in a verdict
(``RankOutput.unsupported``), never silently run unsplit.

Mixed precision (``spec.precision``): ``"fp32"`` (the default) computes in the parameters' own
dtype. The two bf16 forms run over float32 parameters (``spec.dtype == "float32"``), configured the
way users configure them: ``"bf16-fsdp"`` shards with FSDP2's ``MixedPrecisionPolicy(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)`` on every ``fully_shard`` call (forward and backward
in bf16, gradients reduced and kept in float32); ``"bf16-autocast"`` runs the forward and the
loss under ``torch.autocast("cpu"/"cuda", dtype=torch.bfloat16)`` over float32 parameters
(``util.precision_policy`` / ``util.precision_autocast`` build both). A target declares each form
it implements in ``Target.features`` (``FEATURE_BF16_FSDP``, ``FEATURE_BF16_AUTOCAST``); a spec
asking for an undeclared one is answered ``RankOutput.unsupported`` (a failing verdict), never run
in float32.

Checkpoint/resume (``spec.resume_at`` k > 0; 0 = none): the run of ``spec.steps`` K steps is
done as a user with a checkpoint does it, in two calls of ``run`` in two *separate* runs of the
ranks (the suite ends the ranks' run between them: fresh rank processes, a fresh process group,
new target objects). ``spec.phase == "save"``: build everything as above, take steps ``0..k-1``
(reporting them), then save a checkpoint with the implementation's own checkpointing into
``spec.checkpoint_dir`` (an existing, empty directory every rank can reach) and return.
``spec.phase == "load"``: build everything anew, load the checkpoint from ``spec.checkpoint_dir``,
and take steps ``k..K-1``, reporting them (step ``k`` of the load half is step ``k`` of the
uninterrupted run: same global batch, ``StepOutput``s in that numbering). Under Poisson sampling
the K steps are the first K of ``spec.epochs`` epochs (``nominal_steps``); the load half
continues at epoch ``k // int(1/q)``. What must survive is everything the uninterrupted run
carries from step k-1 to step k: parameters and optimizer state (``spec.momentum``), the privacy
accounting's step count (``StepOutput.privacy_steps`` continues at k+1), and the random state of
the noise and of the sampler (noise and batches after the resume must not repeat those before
it). A target declares it with ``"resume"`` in ``Target.features`` and reports
``StepOutput.privacy_steps``; one that does not is answered ``RankOutput.unsupported``.

Privacy accounting (optional; ``docs/adapters.md``): a target reports its accountant at the end of
a run in ``RankOutput``: ``accountant`` (its mechanism, opacus' ``accountant.mechanism()``:
``"rdp"``, ``"prv"``, ``"gdp"``...) and ``accountant_history``, what the accountant was *told*, in
opacus' format ``[(noise_multiplier, sample_rate, steps), ...]`` (``accountant.history``; a resumed
run's includes the restored steps); and, where ``spec.accountant_delta`` > 0, ``epsilon``: the
epsilon it reports at that delta (``accountant.get_epsilon(delta)``). The suite checks them against
the mechanism it measured (docs/properties.md). A target that reports none is not checked.

Momentum (``spec.momentum`` mu > 0; 0 = plain SGD): SGD with torch's momentum (dampening 0, no
Nesterov), the state a checkpoint must carry; declared with ``"momentum"`` in ``Target.features``.

2-D meshes (``spec.mesh``, e.g. ``"hsdp:2x2"`` or ``"tp:2x2"``; ``""`` for the 1-D mesh of every
rank): the target builds the ``DeviceMesh`` itself, ``spec.layout.build("cpu")`` under gloo
(``init_device_mesh(device, (A, B), mesh_dim_names=...)``: ``("replicate", "shard")`` for HSDP,
``("data", "tensor")`` for data x tensor parallel; ``dpfsdp_verify.targets.mesh``). HSDP shards with
``fully_shard(mesh=<the 2-D mesh>)``; ``tp`` applies ``targets.util.tensor_parallel_plan(model)``
on the ``"tensor"`` sub-mesh and keeps the ``"data"`` replicas in sync itself.
``spec.rank_indices`` splits the batch over the data-parallel ranks only (TP peers get the same
samples); every rank reports the full gradient and parameters *as it holds them* (its replica's),
so replicas that drift apart are seen. A target that cannot run a mesh raises ``Refused``.

Progress (for hang reports): a target calls ``progress.step_begun(k, local_batch_size)`` and
``progress.step_finished(k)`` (``dpfsdp_verify.targets.progress``) around each step, and
``progress.pass_begun(k, j, size)`` before each physical pass; the calls append one line to a
per-rank file the parent reads after a hang, so a hang is told in DP terms ("rank 0 ended its
epoch after 3 steps, rank 1 began step 4", with each step's physical passes). They are no-ops
outside a job.

Sampling without training: ``Target.sample_batches(spec)`` (optional) returns, on each rank, the
dataset indices this rank's data pipeline draws at each step of a ``poisson`` spec, built
exactly as ``run`` would build it; a sampling property calls it to draw thousands of batches
in well under a second. The base class says it is not supported, and what a target cannot do is
a verdict: a property that needs it then *fails* ("not checkable on this target: ... does not
expose its data pipeline (Target.sample_batches)"), it does not skip. A user who accepts that says so
explicitly (an ``--expect`` entry).

Devices: a rank computes on ``util.device()``, the device its process group's backend implies
(gloo: the CPU, whatever GPUs the machine has; nccl: the rank's own GPU). An adapter shards on
that device (``fully_shard(..., mesh=util.device_mesh())``), feeds its batches and draws its noise
there, and reports every tensor as float64 on the CPU (``util.gather_named`` does). In a gloo rank
the harness makes torch's accelerator query answer ``cpu`` (``harness.backends.pin_accelerator``),
so a wrapper that cannot be given a mesh (opacus' ``FSDP2Wrapper``) still shards on the CPU.

Refusing: a target that does not support a configuration (tied parameters, say) raises
``Refused(reason)`` from ``run`` on every rank; the case's verdict is ``fail`` / ``refused``.

``sample_batches`` takes an optional *virtual* rank: ``sample_batches(spec, rank=r, world_size=ws)`` returns what
rank ``r`` of a ``ws``-rank job would draw, with no process group (``None``, the default: this
process's real rank and world size). ``dpfsdp-verify scale`` drives it for thousands of virtual
ranks to compute the at-scale hang risk of the pipeline; an adapter written against the older
one-argument signature still works everywhere else, and ``scale`` says it needs the new one.
Optionally, ``sample_masks(spec, rank, world_size)`` returns the same draws as tensors, every
nominal step included (a step the pipeline skips too): ``(indices [n], masks [steps, n] bool,
taken [steps] bool)``, rank ``r``'s dataset indices, each nominal step's inclusion mask over
them and whether the pipeline yields that step; ``scale`` uses it for speed and checks it
against ``sample_batches`` on a subsample of ranks.

Third-party adapters: expose a ``Target`` subclass (or a zero-argument factory returning one)
and point the suite at it with ``--target package.module:Attr`` or the entry-point group
``dpfsdp_verify.targets`` (name -> ``module:attr``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from ..lazy import torch

from ..lazy import models
from ..config.defaults import DEFAULT_GRAD_SAMPLE_MODE, SPEC_DEFAULTS as _D
from ..config.space import choice, combination_problem

# the axes' values are the configuration space's (``dpfsdp_verify.config.space``); a spec's defaults are
# ``defaults.SPEC_DEFAULTS``
DATA_LAYOUTS = choice("data_layout").values
#: how each step's batch is formed: ``fixed`` (given batches) or ``poisson`` (DP-SGD's sampling)
SAMPLINGS = choice("sampling").values
#: how a Poisson run's random source is seeded on the ranks (see module docstring)
SEEDINGS = choice("seeding").values
#: optional features a target declares in ``Target.features`` (a spec asking for an undeclared one
#: is answered ``RankOutput.unsupported``, a failing verdict that says so)
FEATURE_PHYSICAL_BATCHES = "physical_batches"
#: checkpoint/resume (``RunSpec.resume_at``, ``phase``, ``checkpoint_dir``; module docstring)
FEATURE_RESUME = "resume"
#: SGD with momentum (``RunSpec.momentum``): optimizer state a resume must carry
FEATURE_MOMENTUM = "momentum"
#: the halves of a resumed run: ``""`` (not resumed), ``save`` (steps 0..k-1, then checkpoint),
#: ``load`` (load the checkpoint, then steps k..K-1)
RESUME_PHASES = ("", "save", "load")
#: the mixed-precision forms (module docstring): ``fp32`` is no form, just the parameters' dtype
PRECISIONS = choice("precision").values
FEATURE_BF16_FSDP = "bf16-fsdp"
FEATURE_BF16_AUTOCAST = "bf16-autocast"
#: the feature a target declares for each mixed-precision form
PRECISION_FEATURES = {"bf16-fsdp": FEATURE_BF16_FSDP, "bf16-autocast": FEATURE_BF16_AUTOCAST}


def capped_epochs(steps: int, steps_per_epoch: int) -> int:
    """The epochs a Poisson run capped at ``steps`` steps is given: twice what the steps need, so
    that a sampler that skips empty local batches (upstream opacus, docs/findings.md finding 6) never
    runs out of draws on one rank before the cap (that divergence is the whole-epoch scenarios'
    finding, not the capped runs')."""
    return 2 * -(-steps // steps_per_epoch)


@dataclass(frozen=True)
class RunSpec:
    """Everything a target needs to run one configuration; picklable, identical on every rank."""

    model: str = _D["model"]
    model_seed: int = _D["model_seed"]
    global_batch_size: int = _D["global_batch_size"]
    batch_seed: int = _D["batch_seed"]
    data_layout: str = _D["data_layout"]
    reduction: str = _D["reduction"]
    max_grad_norm: float = _D["max_grad_norm"]
    noise_multiplier: float = _D["noise_multiplier"]
    noise_seed: int = _D["noise_seed"]
    steps: int = _D["steps"]
    lr: float = _D["lr"]
    grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE
    dtype: str = _D["dtype"]
    #: explicit uneven split: ``rank_batches[k][r]`` = global indices rank r gets at step k
    rank_batches: Optional[tuple] = None
    #: free-form options a target may read (a fork's flags); never required
    options: tuple = ()
    #: model (and batch) dimensions, sorted ``(key, value)`` pairs of ``models.MODEL_DIMS[model]``
    #: (e.g. ``(("hidden", 3),)``); ``()`` is the default model. Used by ``global_batch`` and by
    #: targets when they build the model.
    model_kwargs: tuple = ()
    #: ``fixed`` or ``poisson`` (module docstring); the fields below matter only for ``poisson``
    sampling: str = _D["sampling"]
    #: q: each sample's probability of being in a step's batch
    sample_rate: float = 0.0
    #: N: samples in the dataset the sampler draws from (the global dataset, all ranks together)
    dataset_size: int = 0
    epochs: int = 1
    seeding: str = _D["seeding"]
    sampling_seed: int = 0
    #: what the ranks are asked for: ``train`` (``Target.run``) or ``sample`` (``Target.sample_batches``)
    task: str = "train"
    #: p: gradient accumulation in physical passes of at most p samples per logical step (module
    #: docstring); 0 = no accumulation (one pass per step)
    physical_batch_size: int = 0
    #: mu: SGD momentum (``torch.optim.SGD(momentum=mu)``); 0 = plain SGD (module docstring)
    momentum: float = 0.0
    #: k: checkpoint after k steps and resume in a fresh run (module docstring); 0 = no resume
    resume_at: int = 0
    #: which half of a resumed run this call is (``RESUME_PHASES``); ``""`` iff ``resume_at == 0``
    phase: str = ""
    #: where the ``save`` half writes its checkpoint and the ``load`` half reads it (the suite's
    #: runner places a relative name under a temporary directory it creates and removes)
    checkpoint_dir: str = ""
    #: ``fp32`` (compute in the parameters' dtype), ``bf16-fsdp`` or ``bf16-autocast`` (bf16 compute
    #: over float32 parameters; module docstring)
    precision: str = _D["precision"]
    #: delta at which the target reports its accountant's epsilon (``RankOutput.epsilon``); 0: not
    #: asked (an epsilon can cost a target's accountant a second per run: only some runs ask)
    accountant_delta: float = 0.0
    #: a 2-D mesh ``KIND:AxB`` (``dpfsdp_verify.targets.mesh``: ``hsdp:RxS``, ``tp:DxT``); ``""``: the 1-D
    #: mesh of every rank (module docstring)
    mesh: str = ""

    def __post_init__(self):
        if self.mesh:
            from .mesh import Mesh

            Mesh.parse(self.mesh)  # MeshError (a ValueError) for a malformed name
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        self._check_resume()
        p = self.physical_batch_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"physical_batch_size must be an int >= 0 (0: no gradient accumulation; p > 0: "
                             f"physical batches of at most p samples), got {p!r}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"unknown sampling {self.sampling!r}; choose one of {', '.join(SAMPLINGS)}")
        if self.task not in ("train", "sample"):
            raise ValueError(f"unknown task {self.task!r}; choose 'train' or 'sample'")
        if self.sampling == "fixed":
            if self.task == "sample":
                raise ValueError("task='sample' needs sampling='poisson'")
        else:
            self._check_poisson()
        # the cross-axis rules: written once, in the configuration space
        problem = combination_problem(dtype=self.dtype, precision=self.precision, sampling=self.sampling,
                                      sample_rate=self.sample_rate, dataset_size=self.dataset_size,
                                      physical_batch_size=self.physical_batch_size, resume_at=self.resume_at,
                                      steps=self.nominal_steps, mesh=self.mesh, data_layout=self.data_layout)
        if problem:
            raise ValueError(problem)

    def _check_poisson(self) -> None:
        q = self.sample_rate
        if not (isinstance(q, (int, float)) and 0.0 < q <= 1.0):
            raise ValueError(f"sample_rate q must be in (0, 1], got {q!r}")
        if self.seeding not in SEEDINGS:
            raise ValueError(f"unknown seeding policy {self.seeding!r}; choose one of {', '.join(SEEDINGS)}")
        if not (isinstance(self.dataset_size, int) and self.dataset_size >= 1):
            raise ValueError(f"dataset_size must be a positive int, got {self.dataset_size!r}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}")
        if not (isinstance(self.steps, int) and self.steps >= 0):
            raise ValueError(f"steps must be an int >= 0 (0: every step of every epoch), got {self.steps!r}")

    @property
    def first_step(self) -> int:
        """The first step this call takes: k in the ``load`` half of a resumed run, else 0."""
        return self.resume_at if self.phase == "load" else 0

    @property
    def end_step(self) -> int:
        """One past the last step this call takes: k in the ``save`` half, else ``nominal_steps``."""
        return self.resume_at if self.phase == "save" else self.nominal_steps

    def _check_resume(self) -> None:
        mu = self.momentum
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0.0 <= mu < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {mu!r}")
        k = self.resume_at
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"resume_at must be an int >= 0 (0: no resume; k > 0: checkpoint after k steps and "
                             f"resume), got {k!r}")
        if self.phase not in RESUME_PHASES:
            raise ValueError(f"unknown resume phase {self.phase!r}; choose 'save' or 'load' (or '' for no resume)")
        if not k:
            if self.phase:
                raise ValueError(f"phase={self.phase!r} needs resume_at > 0 (the step the checkpoint is taken at)")
            return
        if not self.phase or not self.checkpoint_dir:
            raise ValueError("resume_at > 0 is run in two halves: give phase='save' or 'load' and a checkpoint_dir")
        if self.task != "train":
            raise ValueError("resume_at applies to training (task='train') only")

    def check_world_size(self, world_size: int) -> None:
        """``ValueError`` if this spec cannot run at ``world_size`` (a Poisson dataset smaller than
        the world size leaves a rank without a single sample to draw from)."""
        if self.mesh and self.layout.world_size != world_size:
            raise ValueError(f"mesh {self.mesh} has {self.layout.world_size} ranks, not {world_size}")
        if self.sampling == "poisson" and self.dataset_size < world_size:
            raise ValueError(f"dataset_size {self.dataset_size} is smaller than the world size {world_size}: "
                             "some rank would own no sample")

    @property
    def layout(self):
        """The ``mesh.Mesh`` of a 2-D run, ``None`` for a 1-D one."""
        from .mesh import parse_optional

        return parse_optional(self.mesh)

    @property
    def poisson(self) -> bool:
        return self.sampling == "poisson"

    @property
    def expected_batch_size(self) -> int:
        """The divisor of a ``"mean"`` step: the given global batch size (``fixed``), or the
        expected batch size as opacus defines it, ``int(q * dataset_size)`` (``poisson``; opacus
        truncates), whatever the realised batch."""
        if self.sampling == "poisson":
            return int(self.sample_rate * self.dataset_size)
        return self.global_batch_size

    @property
    def divisor(self) -> float:
        """D of a DP step: the released gradient is ``(clipped sum + noise) / D``, with D the
        ``expected_batch_size`` under ``"mean"`` and 1 under ``"sum"``."""
        return float(self.expected_batch_size) if self.reduction == "mean" else 1.0

    @property
    def steps_per_epoch(self) -> int:
        """``int(1/q)`` for ``poisson`` (opacus' ``num_batches``), ``steps`` for ``fixed``."""
        return int(1 / self.sample_rate) if self.sampling == "poisson" else self.steps

    @property
    def nominal_steps(self) -> int:
        """Steps every rank must take: ``steps`` (``fixed``); ``epochs * int(1/q)`` capped at
        ``steps`` when ``steps > 0`` (``poisson``)."""
        if self.sampling != "poisson":
            return self.steps
        total = self.epochs * self.steps_per_epoch
        return min(total, self.steps) if self.steps else total

    def dataset(self) -> models.Batch:
        """The Poisson dataset (``dataset_size`` samples; index ``i`` is sample ``i``)."""
        return models.make_batch(self.model, self.dataset_size, self.batch_seed, dtype=self.torch_dtype,
                                 **dict(self.model_kwargs))

    def seed_sampling(self, rank: int) -> None:
        """Seed torch's global RNG the way ``seeding`` says a user does (Poisson runs)."""
        if self.seeding == "same":
            torch.manual_seed(self.sampling_seed)
        elif self.seeding == "per_rank":
            torch.manual_seed(self.sampling_seed + rank)
        else:
            torch.seed()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward and backward compute in: bfloat16 under a bf16 precision, else
        the parameters' own."""
        return torch.bfloat16 if self.precision != "fp32" else self.torch_dtype

    def global_batch(self, step: int = 0) -> models.Batch:
        return models.make_batch(self.model, self.global_batch_size, self.batch_seed + step, dtype=self.torch_dtype,
                                 **dict(self.model_kwargs))

    def rank_indices(self, step: int, rank: int, world_size: int) -> List[int]:
        """Global sample indices rank ``rank`` processes at ``step``, in order."""
        if self.rank_batches is not None:
            return list(self.rank_batches[step][rank])
        if self.data_layout == "replicated":
            return list(range(self.global_batch_size))
        if self.mesh:  # split over the data-parallel ranks only: TP peers see the same samples
            from .mesh import rank_samples

            return rank_samples(self.layout, self.global_batch_size, rank)
        # DistributedSampler(shuffle=False, drop_last=False) on a divisible batch
        return list(range(rank, self.global_batch_size, world_size))

    def with_(self, **changes) -> "RunSpec":
        return replace(self, **changes)

    def to_json(self) -> str:
        """One line of JSON (what a fuzzed verdict's replay line carries); ``from_json`` reads it."""
        d = asdict(self)
        if not d["mesh"]:  # a 1-D spec's line is what it was before meshes existed
            del d["mesh"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        """The spec ``to_json`` wrote (lists back to the tuples a frozen spec holds); ``ValueError``
        or ``TypeError`` for text that is not one."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        for key in ("rank_batches", "options", "model_kwargs"):
            if d.get(key) is not None:
                d[key] = _tuples(d[key])
        return cls(**d)


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


@dataclass
class StepOutput:
    indices: List[int]
    norms: Optional[torch.Tensor]          # [len(indices)], or None if the target cannot report them
    loss: float
    gradient: Dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: Dict[str, torch.Tensor] = field(default_factory=dict)
    #: sizes of the physical passes this logical step was computed in (``physical_batch_size`` > 0),
    #: in order, empty passes included; ``None``: one pass (no accumulation) or not reported
    physical_batches: Optional[List[int]] = None
    #: the DP steps the target's own privacy accounting has counted after this step (opacus: the
    #: accountant's history); ``None``: not reported (a target declaring ``"resume"`` reports it)
    privacy_steps: Optional[int] = None


@dataclass
class RankOutput:
    rank: int
    world_size: int
    steps: List[StepOutput] = field(default_factory=list)
    #: set when the target cannot do what was asked (e.g. no ``sample_batches``): the case fails saying so
    unsupported: Optional[str] = None
    #: set when the target *refuses* the configuration (it raised ``Refused``, e.g. tied
    #: parameters): the case's verdict is ``fail`` / ``refused`` with this reason
    refused: Optional[str] = None
    #: where the rank computed and under which float32 numerics (``util.device``, ``util.numerics``),
    #: read by the harness after ``run`` returned (a target that changes TF32 is reported as it left
    #: it); every verdict's evidence carries them
    device: str = ""
    numerics: Dict[str, object] = field(default_factory=dict)
    #: the target's privacy accountant at the end of the run (module docstring; ``None``: not
    #: reported): its mechanism (``"rdp"``, ``"prv"``...) and what it was told, opacus'
    #: ``accountant.history``, one ``(noise_multiplier, sample_rate, steps)`` entry per run of equal steps
    accountant: Optional[str] = None
    accountant_history: Optional[List[Tuple[float, float, int]]] = None
    #: the epsilon the accountant reports at ``RunSpec.accountant_delta`` (only where that is > 0)
    epsilon: Optional[float] = None


class Refused(Exception):
    """Raised by ``Target.run`` on every rank, before the ranks part ways (at set-up, or where
    every rank reaches the same point), when the implementation deliberately does not support
    the configuration -- e.g. tied parameters. The suite reports it as a refusal (verdict
    ``fail``, diagnosis ``refused``, the message as given), not as a crash: a clear refusal is
    the honest answer for what an implementation cannot do, and a user accepts it explicitly
    (an expectations entry)."""


class Target:
    """Base class of adapters. Subclasses set ``name`` and implement ``run``."""

    name: str = "target"
    #: optional ``RunSpec`` features this target implements (``FEATURE_PHYSICAL_BATCHES``); a
    #: third-party adapter written before a feature existed declares none and is told so in a
    #: verdict instead of being run without it
    features: tuple = ()

    def version(self) -> str:
        return "unknown"

    def run(self, spec: RunSpec) -> RankOutput:  # pragma: no cover - interface
        raise NotImplementedError

    def sample_batches(self, spec: RunSpec, rank: Optional[int] = None,
                       world_size: Optional[int] = None) -> List[List[int]]:
        """Optional: on each rank, the dataset indices this rank's data pipeline draws at each
        step of the Poisson ``spec`` (module docstring); ``rank``/``world_size`` given: those of a
        virtual rank, no process group needed. Not overriding it is allowed, but a property
        that needs it then fails on this target (it cannot be checked)."""
        raise NotImplementedError(f"target {self.name!r} does not expose its data pipeline "
                                  "(Target.sample_batches)")


__all__ = ["Target", "RunSpec", "capped_epochs", "StepOutput", "RankOutput", "DATA_LAYOUTS", "SAMPLINGS", "SEEDINGS",
           "DEFAULT_GRAD_SAMPLE_MODE", "FEATURE_PHYSICAL_BATCHES", "FEATURE_RESUME", "FEATURE_MOMENTUM",
           "RESUME_PHASES", "PRECISIONS", "FEATURE_BF16_FSDP", "FEATURE_BF16_AUTOCAST", "PRECISION_FEATURES"]
