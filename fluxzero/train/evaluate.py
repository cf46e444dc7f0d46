"""Between steps, what shows what the model learns: a held-out validation loss at fixed timesteps and fixed
noise, and sample images. Both are collectives (every rank calls them at the same step) and both leave
training's random streams as they found them, so a run with them has the losses of a run without.

No deepspeed import: the engine's module is called like the plain model (ZeRO-3 gathers its parameters in the
forward hooks, so under ZeRO-3 every rank takes part in every forward pass).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from fluxzero.config.run import FlowConfig
from fluxzero.config.sections import SampleConfig, ValidationConfig
from fluxzero.data import DataError
from fluxzero.train import flow
from fluxzero.train.checkpoint.store import rng_state, set_rng_state
from fluxzero.train.distributed import TrainingError, all_ranks_ok, all_reduce

VALIDATION_SEED = 1_234_567  # fixed: the same noise for every sample in every run and after every resume


@contextlib.contextmanager
def _same_random_streams():
    """Restore torch/numpy/python (and CUDA) RNG states afterwards: a DataLoader iterator draws a base seed
    from torch's global generator, and training's own draws must not move."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


class Validation:
    """Mean flow-matching loss over every sample of a held-out set at each of fixed timesteps, with fixed
    per-sample noise: deterministic, so its curve compares across runs, resumes and world sizes.

    Each rank evaluates its share of the loader's batches; per-sample sums are all-reduced into one vector of
    the set's size, so the mean counts every sample once (the loader's wrap-around repeats are not counted
    twice) whatever the world size.
    """

    def __init__(
        self,
        cfg: ValidationConfig,
        flow_cfg: FlowConfig,
        model_cfg,
        *,
        micro_batch: int,
        rank: int,
        world: int,
        device,
        dtype: torch.dtype,
    ):
        from fluxzero.data import build_dataloader

        self.loader = build_dataloader(
            cfg.data,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world,
            seed=VALIDATION_SEED,
            pin_memory=device.type == "cuda",
        )
        self.loader.check_model(model_cfg)
        self.flow_cfg, self.timesteps = flow_cfg, [float(t) for t in cfg.timesteps]
        self.guidance_embed, self.device, self.dtype = model_cfg.guidance_embed, device, dtype
        all_ranks_ok(self._sample_problem(rank, world))

    def _sample_problem(self, rank: int, world: int) -> str | None:
        """What is wrong with this rank's share of the validation samples (every world-th), read once at the
        start: a damaged sample would otherwise stop the run at its first validation, steps after the last
        checkpoint. Each read checks the sample's XXH3 checksum (ShardSource.get), and its values must be finite.
        The cost is one read of the validation set split over the ranks, what every validation pass reads."""
        source = self.loader.source
        for i in range(rank, len(source), world):
            try:
                sample = source.get(i)
            except DataError as e:
                return f"validation.data: {e}"
            bad = [k for k in ("latents", "t5", "clip") if not torch.isfinite(sample[k]).all()]
            if bad:
                return (
                    f"validation.data: {source.describe(i)} holds non-finite {bad[0]} values (NaN or inf), which "
                    f"make val_loss NaN; re-create it with `fluxzero cache`, or choose another validation.data"
                )
        return None

    @torch.no_grad()
    def __call__(self, engine) -> float:
        """The validation loss; ValidationFailed on every rank (the same sentence) when a sample cannot be read
        or its loss is not finite."""
        module = engine.module
        was_training = module.training
        n = self.loader.num_samples
        sums = torch.zeros(n, dtype=torch.float64, device=self.device)
        counts = torch.zeros(n, dtype=torch.float64, device=self.device)
        module.eval()
        try:
            with _same_random_streams():
                self.loader.set_epoch(0)
                batches = iter(self.loader)
                while (batch := self._next(batches)) is not None:
                    index = batch["index"].to(self.device)
                    for t in self.timesteps:
                        inputs, target = flow.prepare_batch(
                            batch,
                            self.flow_cfg,
                            VALIDATION_SEED,
                            0,
                            guidance_embed=self.guidance_embed,
                            device=self.device,
                            dtype=self.dtype,
                            timesteps=torch.tensor([t]),
                        )
                        losses = flow.sample_losses(module(**inputs), target).double()  # (B,)
                        sums.index_add_(0, index, losses)
                        counts.index_add_(0, index, torch.ones_like(losses))
        finally:
            module.train(was_training)
        all_reduce(sums)
        all_reduce(counts)
        seen = counts > 0
        per_sample = sums[seen] / counts[seen]
        if not torch.isfinite(per_sample).all():  # every rank holds the same sums: all raise together
            bad = seen.nonzero().flatten()[~torch.isfinite(per_sample)].tolist()
            where = ", ".join(self.loader.source.describe(i) for i in bad[:3]) + (", ..." if len(bad) > 3 else "")
            raise ValidationFailed(
                f"val_loss is not finite: the loss of {where} is NaN or inf; check that "
                f"validation sample, or choose another validation.data"
            )
        return float(per_sample.mean())

    def _next(self, batches):
        """The next batch of this rank, or None after the last; every rank learns whether any failed to read
        one before the forward pass (under ZeRO-3 each forward is a collective of all ranks)."""
        try:
            batch, problem = next(batches), None
        except StopIteration:  # every rank has the same number of batches
            return None
        except DataError as e:
            batch, problem = None, f"validation.data: {e}"
        failed = torch.tensor([problem is not None], dtype=torch.float32, device=self.device)
        all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item():
            try:
                all_ranks_ok(problem)
            except TrainingError as e:
                raise ValidationFailed(str(e)) from None
        return batch


class ValidationFailed(TrainingError):
    """A validation sample that could not be read or gave a non-finite loss (the same sentence on every rank):
    the training step before it is sound, so the trainer saves it before stopping."""


class Previews:
    """Sample images of fixed prompt embeddings and seeds, written to output_dir/samples/step_XXXXXXXX/ and
    returned for TensorBoard. The prompts were encoded once, before training (`fluxzero encode-prompts`), so
    no rank loads T5. Rank 0 decodes and writes; under ZeRO-3 every rank runs the forward passes, below it the
    others wait at the next collective. A FLUX.1 Kontext model edits one reference in every preview, as
    `fluxzero sample --reference` does: sample.reference, else the first pair of `validation`'s set."""

    def __init__(
        self,
        cfg: SampleConfig,
        model_cfg,
        output_dir: str,
        *,
        rank: int,
        stage: int,
        device,
        dtype: torch.dtype,
        validation: Validation | None = None,
    ):
        from fluxzero.sampling.embeddings import EmbeddingsError, load_embeddings
        from fluxzero.sampling.vae import load_vae
        from fluxzero.train.distributed import TrainingError

        self.cfg, self.output_dir, self.rank, self.stage = cfg, output_dir, rank, stage
        self.takes_part = stage == 3 or rank == 0
        # checked on every rank before the first step (a few MB): a file of another T5 width, or NaN, integer or
        # empty embeddings, is refused now by all ranks alike, not at the first preview with nothing saved
        try:
            emb = load_embeddings(cfg.prompts)  # its messages name the file
            try:
                emb.check_model(model_cfg)
            except EmbeddingsError as e:
                raise EmbeddingsError(f"{cfg.prompts}: {e}") from None
        except EmbeddingsError as e:
            raise TrainingError(f"sample.prompts {e}") from None
        self.emb = emb if self.takes_part else None
        # the VAE decodes on rank 0 only; in float32 (a few hundred MB for FLUX's), as `fluxzero sample` does
        self.vae = load_vae(cfg.vae, device=device, dtype=torch.float32) if rank == 0 else None
        self.reference, self.reference_path = self._reference(validation) if model_cfg.kontext else (None, None)

    def _reference(self, validation: Validation | None) -> tuple[torch.Tensor, str]:
        """(scaled reference latents (1, 16, h, w), where they came from) on every rank: sample.reference encoded
        on rank 0 (which holds the VAE) by `fluxzero sample --reference`'s encode_reference and sent to the others,
        or the first validation pair's cached latents, which every rank reads itself. TrainConfig saw to it that
        one of the two is set."""
        from fluxzero.sampling.vae import encode_reference
        from fluxzero.train.distributed import broadcast_objects

        path = self.cfg.reference
        if not path:
            source = validation.loader.source
            return source.get(0)["reference"][None].float(), f"{source.describe(0)} (validation.data)"
        latents, problem = None, None
        if self.rank == 0:  # the file exists (loop._check_inputs)
            width, height = self.cfg.wh
            try:
                latents = encode_reference(self.vae, path, height=height, width=width)
            except DataError as e:
                problem = f"sample.reference: {e}"
        latents, problem = broadcast_objects([latents, problem])
        if problem:
            raise TrainingError(problem)
        return latents, str(Path(path).resolve())

    def __call__(self, engine, step: int) -> tuple[list[Path], float]:
        """(PNG paths written (rank 0; [] elsewhere), seconds it took).

        Previews never cost the training: when rank 0 cannot write them (output_dir/samples is a file, a full
        disk) it says so in one line and training goes on. Its folder is made before sampling, so that under
        ZeRO-3 rank 0 still takes part in every forward pass the other ranks make when it cannot write."""
        from fluxzero.sampling.pipeline import sample_images
        from fluxzero.train.distributed import write_line

        t0 = time.perf_counter()
        paths: list[Path] = []
        if self.takes_part:
            out = Path(self.output_dir) / "samples" / f"step_{step:08d}" if self.rank == 0 else None
            problem = None
            try:
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                problem, out = e, None
            width, height = self.cfg.wh
            try:
                with _same_random_streams():
                    paths = sample_images(
                        engine.module,
                        self.vae,
                        self.emb,
                        out,
                        width=width,
                        height=height,
                        steps=self.cfg.steps,
                        seeds=self.cfg.seeds,
                        guidance=self.cfg.guidance,
                        weights=f"step {step} ({self.cfg.weights} weights)",
                        reference=self.reference,
                        reference_path=self.reference_path,
                    )
            except OSError as e:  # a PNG write: the sampling itself is done
                problem, paths = e, []
            if problem is not None:
                where = Path(self.output_dir) / "samples" / f"step_{step:08d}"
                write_line(
                    f"warning: the preview images of step {step} were not written to {where} "
                    f"({problem.strerror or problem}); training goes on: make that folder writable for the "
                    f"next previews"
                )
        return paths, time.perf_counter() - t0
