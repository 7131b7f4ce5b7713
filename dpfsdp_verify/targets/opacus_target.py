"""The built-in target: whatever ``opacus`` is importable, driven only through its public API.

On each rank: ``FSDP2Wrapper(model)`` -> ``PrivacyEngine().make_private(...,
grad_sample_mode=spec.grad_sample_mode, poisson_sampling=False, noise_generator=<seeded>)`` ->
``loss = criterion(...)``; ``loss.backward()`` (ghost clipping's two backward passes) ->
``optimizer.step()``. This is how a user trains, so the suite judges what a user gets.

Data is fed the way opacus expects under FSDP (``make_private`` divides the expected batch size
by the world size): a ``DataLoader`` over the *global* dataset (all steps' global batches
concatenated) with a ``DistributedSampler`` for split data, or -- for ``spec.rank_batches`` -- a
batch sampler that yields exactly the requested global indices. Replicated data is a plain
``DataLoader`` of the whole global batch on every rank; opacus defines a DP *step* only for split
data (see ``properties``), but its per-sample norms are well defined for both layouts.

Poisson sampling (``spec.sampling == "poisson"``) runs exactly as a user does: a ``DataLoader``
with a ``DistributedSampler`` over the global dataset (``spec.dataset()``, an index column
carried along) whose local batch size makes opacus derive ``q = 1/len(data_loader)`` equal to
``spec.sample_rate`` (``opacus_local_batch_size``), the random source seeded as ``spec.seeding``
says, then ``make_private(poisson_sampling=True)``, which swaps in opacus'
``DistributedUniformWithReplacementSampler``; every batch the loader yields is a step, for
``spec.epochs`` epochs (at most ``spec.steps`` steps when ``steps > 0``). ``sample_batches``
builds the same loader with ``DPDataLoader.from_data_loader(..., distributed=True)`` -- what
``make_private`` calls -- and returns the indices it draws, without training; for a virtual rank
(``sample_batches(spec, rank, world_size)``, no process group) opacus' sampler is built exactly
so, with ``torch.distributed.get_rank/get_world_size`` answering the virtual rank while it is
constructed (it reads them once, in ``__init__``). ``sample_masks`` replays that sampler's draws
as one tensor: the same ``torch.rand(num_samples)`` calls on the same generator in the same
order (``torch.rand(steps, n)`` consumes the CPU generator exactly as ``steps`` calls of
``torch.rand(n)``), every nominal step kept, including the empty ones the sampler skips.

Refusals: opacus 1.6.0 does not train tied parameters under FSDP. ``FSDP2Wrapper`` shards the
embedding and the head that share a weight as two FSDP groups, which torch refuses at set-up
(``ValueError: Parameter ... is shared with a parameter already managed by another FSDP
group``); a module called twice trips ghost clipping's own guard in the first forward
(``NotImplementedError: Parameter tying is not supported ...``). Both are raised on every rank
at the same point, and are reported as ``targets.Refused`` with upstream's message (verdict
``fail`` / ``refused``), not as a crash. Any other exception stays a crash.

Gradient accumulation (``spec.physical_batch_size`` p > 0) is opacus' own, as a user runs it:
``with BatchMemoryManager(data_loader=loader, max_physical_batch_size=p, optimizer=optimizer)``,
one forward/backward and ``optimizer.step()`` per physical batch; the optimizer takes the real
step only after the last physical batch of a logical one (``BatchSplittingSampler`` signals the
others as skipped). The same wrapper splits fixed batches (``ceil(local / p)`` passes each). A
logical step ends where the optimizer did not skip (``optimizer._is_last_step_skipped`` after the
step: opacus' own record of it); its ``StepOutput`` gathers the passes' indices and norms.

Mixed precision (``spec.precision``) as a user configures it with opacus: ``bf16-fsdp`` passes
``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` to
``FSDP2Wrapper`` (which hands it to every ``fully_shard`` call); ``bf16-autocast`` runs the
forward and the loss under ``torch.autocast(..., dtype=torch.bfloat16)``; both over float32
parameters. The backward runs outside autocast, as autocast's own recipe says.

Checkpoint/resume (``spec.resume_at`` k, ``spec.phase``; ``docs/resume.md``) is what a user does
under FSDP2, where every rank holds different shards: the model's and the optimizer's state with
``torch.distributed.checkpoint`` (``get_state_dict`` of the FSDP module and of the optimizer
opacus wraps, ``dcp.save``; ``dcp.load`` + ``set_state_dict`` into the fresh ones), and opacus'
own state -- the accountant's ``state_dict``, what ``PrivacyEngine.save_checkpoint`` stores under
``privacy_accountant_state_dict`` -- written by rank 0 and loaded by every rank into its new
``PrivacyEngine``. ``PrivacyEngine.save_checkpoint`` itself ``torch.save``s one un-sharded
``module.state_dict()``, which FSDP2's DTensor shards do not fit. The resumed job is the same script
run again: the random sources seeded as at the start of the first job (``spec.seeding``, the
noise generator from ``spec.noise_seed``), since neither opacus' checkpoint nor DCP carries them;
it continues at epoch ``k // int(1/q)``, skipping ``k mod int(1/q)`` batches of it by drawing them.
``StepOutput.privacy_steps`` is the accountant's step count (the sum over its history).

Devices (``util.device()``, docs/gpu.md): the model is sharded, the batches are fed and the noise
generator is made on the device the process group's backend implies: the CPU under gloo whatever
the machine has, the rank's own GPU under nccl. ``FSDP2Wrapper`` has no ``mesh`` argument, so
FSDP2's default mesh decides where the parameters go; the harness makes it follow the backend
(``harness.backends.pin_accelerator``). Reported tensors come back as float64 on the CPU.
Accounting: ``RankOutput.accountant`` / ``accountant_history`` are opacus' own accountant's
``mechanism()`` and ``history`` at the end of the run (what its optimizer step hook told it), and
``RankOutput.epsilon`` its ``get_epsilon(spec.accountant_delta)`` where the spec asks.

2-D meshes (``spec.mesh``, ``docs/meshes.md``). HSDP (``hsdp:RxS``) is ``FSDP2Wrapper`` on the
2-D mesh: opacus 1.6.0's ``FSDP2Wrapper`` takes no ``mesh`` (it reads only ``mp_policy`` and
``opacus_high_precision_layers`` and calls ``fully_shard(module, mp_policy=...)``), so while it
runs its module's ``fully_shard`` is the same function with ``mesh=`` the
``("replicate", "shard")`` mesh: the same layers wrapped the same way, on the 2-D mesh; the rest
(``make_private``, the data path) is the 1-D path. Data x tensor parallel (``tp:DxT``) is what
opacus' own ``examples/tensor_parallelism_toy.py`` does, on the ``"tensor"`` sub-mesh:
``parallelize_module(model, mesh["tensor"], util.tensor_parallel_plan(model))`` ->
``GradSampleModuleFastGradientClippingTP`` -> ``FSDPOptimizerFastGradientClipping`` (the expected
batch of one data replica, B/D, and the seeded noise generator) -> ``DPLossFastGradientClipping``.
ghost_tp has no data-parallel reduction of its own and cannot be combined with ``fully_shard``
(its ``GradSampleModule`` deep-copies the module, which FSDP2 forbids), so the adapter averages
each gradient over the ``"data"`` sub-mesh after the backward, as DDP/FSDP average, before
``optimizer.step()`` adds the noise. What ghost_tp refuses (``NotImplementedError``: replicated
DTensor parameters) is a ``Refused``.

Fork switches (``OPACUS_USE_DEFERRED_NORM``...) are environment variables of the worker group, not
arguments here.
"""

from __future__ import annotations

import contextlib
import functools
from typing import List, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn

from .. import models
from . import progress
from .base import (FEATURE_BF16_AUTOCAST, FEATURE_BF16_FSDP, FEATURE_MOMENTUM, FEATURE_PHYSICAL_BATCHES, FEATURE_RESUME,
                   RankOutput, Refused, RunSpec, StepOutput, Target)
from .util import (dataset_index, device, device_mesh, gather_named, global_dataset, load_sharded, local_batch,
                   precision_autocast, precision_policy, rank_and_world, save_sharded, step_indices,
                   tensor_parallel_plan, world)

#: opacus' own state in a resumed run's checkpoint directory (written by rank 0)
OPACUS_STATE = "opacus_state.pt"


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int, virtual: bool):
    """While opacus' distributed sampler is built, ``torch.distributed`` answers the virtual rank."""
    if not virtual:
        yield
        return
    import torch.distributed as dist

    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda group=None: rank
    dist.get_world_size = lambda group=None: world_size
    try:
        yield
    finally:
        dist.get_rank, dist.get_world_size = saved


def opacus_local_batch_size(spec: RunSpec, world_size: int) -> int:
    """The local batch size b for which opacus derives ``sample_rate = 1/len(data_loader)`` equal
    to ``spec.sample_rate`` over a ``DistributedSampler`` (each rank holds ``ceil(N/ws)`` samples,
    so ``len(data_loader) = ceil(ceil(N/ws)/b)``). ``InexpressibleRate`` naming the two rates
    nearest to q that opacus can give when q is not one of them."""
    n_local = -(-spec.dataset_size // world_size)
    for b in range(1, n_local + 1):
        if abs(1.0 / -(-n_local // b) - spec.sample_rate) <= 1e-12:
            return b
    steps = sorted({-(-n_local // b) for b in range(1, n_local + 1)})  # len(data_loader) for each b
    below = [m for m in steps if 1.0 / m < spec.sample_rate]
    above = [m for m in steps if 1.0 / m > spec.sample_rate]
    nearest = ([min(below)] if below else []) + ([max(above)] if above else [])
    raise InexpressibleRate(f"opacus derives q = 1/len(data_loader); with dataset_size={spec.dataset_size} at "
                            f"world size {world_size} the rates nearest to {spec.sample_rate} it can run are "
                            + " and ".join(f"1/{m} = {1.0 / m:.6g}" for m in nearest),
                            rates=[1.0 / m for m in nearest])


class InexpressibleRate(Refused, ValueError):
    """A sample rate opacus cannot be configured with: a refusal on the ranks (every rank reaches
    it at set-up), a ``ValueError`` to a caller that asked. ``rates``: the nearest ones it can
    run (below and above), for a hint."""

    def __init__(self, message: str, rates: Sequence[float] = ()):
        super().__init__(message)
        self.rates = list(rates)


@functools.lru_cache(maxsize=4)
def _index_dataset(n: int):
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.arange(n))


@functools.lru_cache(maxsize=4)
def _split_order(n: int, shuffle: bool, seed: int) -> torch.Tensor:
    """The dataset order opacus' distributed sampler splits among ranks (its ``__iter__``: a
    permutation from its own shuffle seed, never the global RNG); the same for every rank."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)


class _ExactBatches(torch.utils.data.Sampler):
    """A batch sampler yielding the given lists of dataset indices, in order (may be empty)."""

    def __init__(self, batches: List[List[int]]):
        self.batches = [list(b) for b in batches]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


#: the messages of upstream's deliberate refusals of tied parameters (module docstring)
TYING_REFUSALS = ("Parameter tying is not supported", "is shared with a parameter already managed by another FSDP "
                                                      "group")


class OpacusTarget(Target):
    name = "opacus"
    features = (FEATURE_PHYSICAL_BATCHES, FEATURE_RESUME, FEATURE_MOMENTUM, FEATURE_BF16_FSDP, FEATURE_BF16_AUTOCAST)

    def version(self) -> str:
        import opacus

        return getattr(opacus, "__version__", "unknown")

    def _data_loader(self, spec: RunSpec, dataset, rank: int, world_size: int):
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        b = spec.global_batch_size
        if spec.rank_batches is not None:
            batches = [[k * b + i for i in spec.rank_indices(k, rank, world_size)] for k in range(spec.steps)]
            return DataLoader(dataset, batch_sampler=_ExactBatches(batches), collate_fn=_Collate(dataset))
        if spec.data_layout == "replicated":
            return DataLoader(dataset, batch_size=b, shuffle=False)
        if b % world_size:
            raise ValueError(f"split data needs global_batch_size divisible by world_size "
                             f"({b} % {world_size} != 0); pass rank_batches for an uneven split")
        sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=b // world_size, sampler=sampler)

    def _poisson_loader(self, spec: RunSpec, dataset, rank: int, world_size: int):
        """What a user hands ``make_private``: a DistributedSampler over the global dataset."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        spec.check_world_size(world_size)
        sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=opacus_local_batch_size(spec, world_size), sampler=sampler)

    def _poisson_dataset(self, spec: RunSpec):
        from torch.utils.data import TensorDataset

        data = spec.dataset()
        return data, TensorDataset(data.inputs, data.targets, torch.arange(spec.dataset_size))

    def _dp_sampler(self, spec: RunSpec, rank: Optional[int], world_size: Optional[int]):
        """``(rank, world_size, opacus' batch sampler)`` as ``make_private(poisson_sampling=True)``
        builds it from the user's loader; the dataset is the index column alone (the sampler
        reads only its length; the indices it yields are what is reported)."""
        from opacus.data_loader import DPDataLoader

        virtual = rank is not None or world_size is not None
        rank, world_size = rank_and_world(rank, world_size)
        dataset = _index_dataset(spec.dataset_size)
        with _as_rank(rank, world_size, virtual):
            loader = DPDataLoader.from_data_loader(self._poisson_loader(spec, dataset, rank, world_size),
                                                   distributed=True)
        return rank, world_size, loader.batch_sampler

    def sample_batches(self, spec: RunSpec, rank: Optional[int] = None,
                       world_size: Optional[int] = None) -> List[List[int]]:
        rank, world_size, sampler = self._dp_sampler(spec, rank, world_size)
        spec.seed_sampling(rank)
        out: List[List[int]] = []
        for _ in range(spec.epochs):
            for idx in sampler:
                if spec.steps and len(out) >= spec.steps:
                    return out
                out.append([int(i) for i in idx])
        return out

    def sample_masks(self, spec: RunSpec, rank: int, world_size: int):
        """``(indices [n], masks [steps, n], taken [steps])``: the draws of ``sample_batches`` for
        one epoch, every nominal step kept (``Target`` docstring). The same sampler object, its
        own ``num_samples``/``sample_rate``/``num_batches``/``generator``, its own split of the
        (shuffled) dataset; ``taken``: the steps it yields (it skips an empty local batch)."""
        if spec.epochs != 1 or spec.steps:
            raise ValueError("sample_masks replays one whole epoch: epochs=1, steps=0")
        key = (spec.with_(sampling_seed=0, seeding="same"), rank, world_size)
        if getattr(self, "_mask_sampler", (None,))[0] != key:  # the sampler does not depend on the seed
            self._mask_sampler = (key, self._dp_sampler(spec, rank, world_size))
        rank, world_size, s = self._mask_sampler[1]
        indices = _split_order(s.total_size, s.shuffle, s.shuffle_seed + s.epoch)[s.rank:s.total_size:s.num_replicas]
        spec.seed_sampling(rank)
        # in chunks of rows (memory): consecutive torch.rand calls continue the generator's stream
        rows = max(1, (1 << 22) // max(1, s.num_samples))
        masks = torch.cat([torch.rand(min(rows, s.num_batches - k), s.num_samples, generator=s.generator)
                           < s.sample_rate for k in range(0, s.num_batches, rows)])
        return indices, masks, masks.any(1)

    def run(self, spec: RunSpec) -> RankOutput:
        try:
            return self._run(spec)
        except (ValueError, NotImplementedError) as e:
            if any(m in str(e) for m in TYING_REFUSALS):
                raise Refused(f"opacus {self.version()} refuses tied parameters: {type(e).__name__}: {e}") from e
            raise

    def _run(self, spec: RunSpec) -> RankOutput:
        from opacus import PrivacyEngine
        from opacus.utils.fsdp_utils import FSDP2Wrapper
        from torch.utils.data import TensorDataset

        rank, world_size = world()
        if spec.mesh and spec.layout.tensor_parallel:
            return self._run_tensor_parallel(spec, rank, world_size)
        model = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype, **dict(spec.model_kwargs))
        policy = precision_policy(spec)
        with _fully_shard_on(device_mesh(spec) if spec.mesh else None):
            fsdp = FSDP2Wrapper(model) if policy is None else FSDP2Wrapper(model, mp_policy=policy)
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=spec.lr, momentum=spec.momentum)
        if spec.poisson:
            data, dataset = self._poisson_dataset(spec)
            loader = self._poisson_loader(spec, dataset, rank, world_size)
            spec.seed_sampling(rank)
        else:
            data = global_dataset(spec)
            # the index column travels with each sample: the indices reported are the ones the loader yielded
            loader = self._data_loader(spec, TensorDataset(data.inputs, data.targets, dataset_index(spec)), rank,
                                       world_size)
        criterion = _criterion(data.loss, spec.reduction)
        # the noise is drawn where the gradient lives: a CPU generator cannot feed CUDA noise
        generator = torch.Generator(device=device()).manual_seed(spec.noise_seed)
        engine = PrivacyEngine()
        module, optimizer, criterion, loader = engine.make_private(
            module=fsdp, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.max_grad_norm,
            poisson_sampling=spec.poisson, grad_sample_mode=spec.grad_sample_mode, loss_reduction=spec.reduction,
            noise_generator=generator)
        module.train()
        if spec.phase == "load":
            import os

            load_sharded(fsdp, optimizer.original_optimizer, spec.checkpoint_dir)
            state = torch.load(os.path.join(spec.checkpoint_dir, OPACUS_STATE), weights_only=False)
            engine.accountant.load_state_dict(state["privacy_accountant_state_dict"])
        self._accountant = engine.accountant
        out = RankOutput(rank=rank, world_size=world_size)
        if spec.physical_batch_size:
            from opacus.utils.batch_memory_manager import BatchMemoryManager

            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=spec.physical_batch_size,
                                    optimizer=optimizer) as physical:
                self._train(spec, data, module, optimizer, criterion, physical, out)
        else:
            self._train(spec, data, module, optimizer, criterion, loader, out)
        self._report_accountant(spec, out)
        if spec.phase == "save":
            import os

            save_sharded(fsdp, optimizer.original_optimizer, spec.checkpoint_dir)
            if rank == 0:
                torch.save({"privacy_accountant_state_dict": engine.accountant.state_dict()},
                           os.path.join(spec.checkpoint_dir, OPACUS_STATE))
        return out

    def _train(self, spec: RunSpec, data, module, optimizer, criterion, loader, out: RankOutput) -> None:
        """Every batch the loader yields through forward, backward and ``optimizer.step()``; a
        logical step ends where the optimizer really stepped (always, without accumulation)."""
        accumulating = bool(spec.physical_batch_size)
        norm_parts: List[Optional[torch.Tensor]]
        losses: List[Tuple[float, int]]  # (mean loss, samples) per physical batch
        k, index_parts, norm_parts, losses = spec.first_step, [], [], []
        on = device()
        # under accumulation the loader yields physical batches: the step budget counts logical
        # steps (below); resume is not combined with accumulation (RunSpec refuses it), so k starts at 0
        for x, y, index in self._batches(spec.with_(steps=0) if accumulating and spec.poisson else spec, loader):
            if not losses:
                progress.step_begun(k, None if accumulating else len(index))
            if accumulating:
                progress.pass_begun(k, len(losses), len(index))
            optimizer.zero_grad()
            x, y = x.to(on), y.to(on)
            with precision_autocast(spec):
                loss = dp_loss(criterion, module(x), y, data.loss)
            loss.backward()
            norms = getattr(module, "per_sample_gradient_norms", None)
            norm_parts.append(None if norms is None else norms.detach().to(torch.float64).reshape(-1).cpu().clone())
            index_parts.append(index)
            losses.append((float(loss.item()), len(index)))
            optimizer.step()
            if accumulating and getattr(optimizer, "_is_last_step_skipped", False):
                continue  # a physical batch that is not the last of its logical batch
            # the DP step is taken: what follows only reports it (its gathers are the suite's, not training's)
            progress.step_finished(k)
            named = list(module.named_parameters())
            index = torch.cat([torch.as_tensor(i).reshape(-1) for i in index_parts])
            indices = [int(i) for i in index] if spec.poisson else step_indices(index, spec, k)
            norms = None if any(n is None for n in norm_parts) else torch.cat(cast(List[torch.Tensor], norm_parts))
            out.steps.append(StepOutput(
                indices=indices, norms=norms, loss=self._step_loss(spec, losses),
                gradient=gather_named(named, "grad"), parameters=gather_named(named, "param"),
                physical_batches=[n for _, n in losses] if accumulating else None,
                privacy_steps=int(sum(h[-1] for h in self._accountant.history))))
            k, index_parts, norm_parts, losses = k + 1, [], [], []
            if accumulating and spec.poisson and spec.steps and k >= spec.steps:
                return

    def _report_accountant(self, spec: RunSpec, out: RankOutput) -> None:
        """What opacus' own accountant was told (its ``history``) and, where the spec asks, the
        epsilon it reports (``get_epsilon(delta)``: the PRV accountant by default, ~0.1-1 s)."""
        acc = self._accountant
        out.accountant = acc.mechanism()
        out.accountant_history = [(float(s), float(q), int(n)) for s, q, n in acc.history]
        if spec.accountant_delta > 0 and acc.history and all(s > 0 for s, _, _ in acc.history):
            out.epsilon = float(acc.get_epsilon(delta=spec.accountant_delta))

    def _run_tensor_parallel(self, spec: RunSpec, rank: int, world_size: int) -> RankOutput:
        """Data x tensor parallel as opacus' TP example builds it (module docstring)."""
        import torch.distributed as dist
        from opacus.grad_sample import GradSampleModuleFastGradientClippingTP
        from opacus.optimizers import FSDPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        from torch.distributed.tensor.parallel import parallelize_module

        layout = spec.layout
        mesh = device_mesh(spec)
        model = models.build_model(spec.model, spec.model_seed, dtype=spec.torch_dtype, **dict(spec.model_kwargs))
        model = parallelize_module(model, mesh["tensor"], tensor_parallel_plan(model))
        try:
            module = GradSampleModuleFastGradientClippingTP(model, loss_reduction=spec.reduction, batch_first=True,
                                                            max_grad_norm=spec.max_grad_norm)
        except NotImplementedError as e:
            raise Refused(f"opacus {self.version()} ghost_tp: NotImplementedError: {e}") from e
        optimizer = FSDPOptimizerFastGradientClipping(
            torch.optim.SGD(module.parameters(), lr=spec.lr, momentum=spec.momentum),
            noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.max_grad_norm,
            expected_batch_size=spec.expected_batch_size // layout.data_degree, loss_reduction=spec.reduction,
            generator=torch.Generator().manual_seed(spec.noise_seed))
        criterion = DPLossFastGradientClipping(module, optimizer, _criterion(spec.global_batch(0).loss, spec.reduction),
                                               loss_reduction=spec.reduction)
        data_group, data_degree = mesh["data"].get_group(), layout.data_degree
        out = RankOutput(rank=rank, world_size=world_size)
        for k in range(spec.steps):
            indices, batch = local_batch(spec, k, rank, world_size)
            optimizer.zero_grad()
            loss = dp_loss(criterion, module(batch.inputs), batch.targets, batch.loss)
            loss.backward()
            with torch.no_grad():  # the data replicas' average, as DDP/FSDP reduce (module docstring)
                for p in module.parameters():
                    if p.grad is not None:
                        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        dist.all_reduce(local, group=data_group)
                        local.div_(data_degree)
            norms = module.per_sample_gradient_norms.detach().to(torch.float64).reshape(-1).clone()
            optimizer.step()
            named = list(module.named_parameters())
            out.steps.append(StepOutput(indices=indices, norms=norms, loss=float(loss.item()),
                                        gradient=gather_named(named, "grad"), parameters=gather_named(named, "param")))
        return out

    @staticmethod
    def _step_loss(spec: RunSpec, losses) -> float:
        """The logical step's local loss from its passes' ``(loss, size)``: the sum (``"sum"``), or the
        mean over the step's samples (``"mean"``: each pass's mean weighted by its size)."""
        if len(losses) == 1 or spec.reduction != "mean":
            return float(sum(v for v, _ in losses))
        n = sum(m for _, m in losses)
        return float(sum(v * m for v, m in losses) / n) if n else 0.0

    @staticmethod
    def _batches(spec: RunSpec, loader):
        """Every batch the loader yields: one pass (fixed), or ``spec.epochs`` passes capped at
        ``spec.steps`` steps when ``steps > 0`` (poisson: a user training for a step budget). A
        resumed run's halves: steps ``0..k-1`` (save), or from step k on (load: fixed batches skip
        the first k; Poisson starts at epoch ``k // int(1/q)`` and skips ``k mod int(1/q)``
        batches of it, drawing them, as a user's resume loop does)."""
        if not spec.poisson and not spec.resume_at:
            yield from loader  # under accumulation: physical batches, as many as the passes
            return
        if not spec.poisson:
            for k, batch in enumerate(loader):
                if k >= spec.end_step:
                    return
                if k >= spec.first_step:
                    yield batch
            return
        first_epoch, skip = divmod(spec.first_step, spec.steps_per_epoch)
        k = first_epoch * spec.steps_per_epoch
        for _ in range(first_epoch, spec.epochs):
            for batch in loader:
                if spec.resume_at and k >= spec.end_step:
                    return
                if skip:
                    skip, k = skip - 1, k + 1
                    continue
                if spec.steps and k >= spec.steps:
                    return
                yield batch
                k += 1


def _criterion(loss, reduction: str) -> nn.Module:
    """What ``make_private`` is handed: cross-entropy, or a model's own per-sample loss
    (``docs/models.md``) as a criterion module opacus can set to ``reduction="none"``."""
    if callable(loss):
        from ..models.contract import ContractCriterion

        return ContractCriterion(loss, reduction)
    return nn.CrossEntropyLoss(reduction=reduction)


def dp_loss(criterion, logits: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """The batch loss through opacus' DP criterion; for ``token_cross_entropy`` the privacy unit is
    the sequence: opacus needs the ``[B, T, V]`` shape (``shape=``) to regroup the token losses."""
    if loss == "token_cross_entropy":
        return criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=logits.shape)
    return criterion(logits, targets)


@contextlib.contextmanager
def _fully_shard_on(mesh):
    """While ``FSDP2Wrapper`` runs, its ``fully_shard`` shards on ``mesh`` (``None``: unchanged):
    opacus 1.6.0's wrapper does not forward a ``mesh`` (module docstring)."""
    if mesh is None:
        yield
        return
    from opacus.utils import fsdp_utils

    saved = fsdp_utils.fully_shard
    fsdp_utils.fully_shard = functools.partial(saved, mesh=mesh)
    try:
        yield
    finally:
        fsdp_utils.fully_shard = saved


class _Collate:
    """Stack samples; an empty index list gives zero-length tensors of the right trailing shape
    (the default collate cannot), so an empty local batch reaches the implementation."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, samples):
        from ..models.contract import stack_samples  # inputs may be a dict of tensors (docs/models.md)

        if not samples:
            return tuple(t[:0] for t in self.dataset.tensors)
        return tuple(stack_samples([s[j] for s in samples]) for j in range(len(samples[0])))


__all__ = ["OPACUS_STATE", "opacus_local_batch_size", "InexpressibleRate", "TYING_REFUSALS", "OpacusTarget", "dp_loss"]
