"""The itemised estimate of one rank: `estimate(spec)` sums model states, communication and activations into an
Estimate, which answers allocated / reserved / total GPU bytes per phase and host bytes per rank and node.

Pure Python (no torch, no deepspeed).
"""

from __future__ import annotations

from dataclasses import dataclass

from fluxzero.plan.activations import activation_bytes, activation_items
from fluxzero.plan.model_states import communication_items, model_state_items
from fluxzero.plan.spec import FRAGMENTATION, PHASES, GiB, Item, RunSpec, param_inventory


@dataclass
class Estimate:
    spec: RunSpec
    items: list[Item]

    def _sum(self, where: str, phases: tuple[str, ...], ds_only: bool = False) -> int:
        return sum(i.bytes for i in self.items if i.where == where and i.phase in phases and (i.ds or not ds_only))

    def gpu_phase(self, phase: str, ds_only: bool = False) -> int:
        """Allocated bytes per GPU at the peak of `phase`: "train" (forward/backward), "step" (optimizer
        step), or "init" (building the model and the engine, before any resident state exists)."""
        return self._sum("gpu", (phase,) if phase == "init" else ("resident", phase), ds_only)

    @property
    def gpu_allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated() per rank."""
        return max(self.gpu_phase(p) for p in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.gpu_phase)

    @property
    def gpu_resident(self) -> int:
        """Allocated bytes held all step long (model states, buckets): allocated once, never freed."""
        return self._sum("gpu", ("resident",))

    @property
    def fragmentation(self) -> float:
        """The caching allocator's reserve beyond the allocated peak, as a fraction of the per-step transients
        (peak allocated - resident): what is allocated and freed every step (activations, gathered
        parameters, gradients, the step's copies) leaves cached blocks that later requests of other sizes
        (or on other streams) cannot reuse. Model states are allocated once and do not fragment.

        Fitted on GPU runs, each regime on some runs and checked on others held out
        (benchmarks/fragmentation_fit.py: f minimises the largest relative error of the predicted reserved
        memory over the fit runs; which runs, and the errors, in benchmarks/RESULTS.md):
        - stage 0, 0.19: the step's per-tensor gradients and fp32 copies have the sizes of the fp32 model's
          tensors freed at engine start, so they mostly reuse those cached blocks;
        - stages 1-2, 0.33: the step's flat copies reuse much of the activations' cached memory;
        - stage 3, 0.8: the step's copies are flat sub-groups and training's are tensor-sized activations and
          gathered parameters on their own streams: neither set reuses the other's cached blocks;
        - expandable_segments, 0.05: segments grow and shrink in place, little is stranded (not refitted).
        """
        if self.spec.fragmentation is not None:
            return self.spec.fragmentation
        if self.spec.expandable_segments:
            return 0.05
        return FRAGMENTATION[min(self.spec.stage, 2) if self.spec.stage < 3 else 3]

    @property
    def gpu_reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved() per rank: resident states plus the transients with
        their fragmentation."""
        resident = self.gpu_resident
        return int(resident + (self.gpu_allocated - resident) * (1 + self.fragmentation))

    @property
    def gpu_total(self) -> int:
        """What the GPU must have: reserved plus the CUDA context outside PyTorch's allocator."""
        return self.gpu_reserved + int(self.spec.cuda_context_gib * GiB)

    def host_per_rank(self, ds_only: bool = False) -> int:
        """Host bytes of one rank: the larger of model loading and the run's resident host state."""
        running = self._sum("host", ("resident",), ds_only) + max(self._sum("host", (p,), ds_only) for p in PHASES)
        return max(self._sum("host", ("load",), ds_only), running)

    @property
    def host_per_node(self) -> int:
        return self.host_per_rank() * self.spec.gpus_per_node

    @property
    def nvme_per_node(self) -> int:
        return self._sum("nvme", ("resident",)) * self.spec.gpus_per_node

    def deepspeed_view(self) -> tuple[int, int]:
        """(GPU bytes per rank, host bytes per node) counted the way DeepSpeed's
        estimate_zero2/zero3_model_states_mem_needs count them: every model-state item DeepSpeed knows,
        all phases summed, host without its additional_buffer_factor."""
        gpu = sum(i.bytes for i in self.items if i.where == "gpu" and i.ds)
        return gpu, self.host_per_rank(ds_only=True) * self.spec.gpus_per_node

    def group(self, where: str = "gpu") -> list[Item]:
        return [i for i in self.items if i.where == where and i.bytes]


def estimate(spec: RunSpec) -> Estimate:
    """Itemised memory of one rank (GPU) and one node (host) for `spec`."""
    inv = param_inventory(spec.model)
    acts = activation_bytes(spec)  # once: the model states' fused-step item reads it too
    items = model_state_items(spec, inv, acts) + communication_items(spec, inv) + activation_items(spec, acts)
    return Estimate(spec, items)
