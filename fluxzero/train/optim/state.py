"""Optimizer checkpoints that round-trip exactly: ExactStateMixin, shared by fluxzero.train.optim.optimizers's optimizers and
fluxzero.train.optim.host's (a module of its own so that both can build on it without importing each other)."""

from __future__ import annotations

from itertools import chain

import torch

_PACKED = "fluxzero_optim_state8bit"


class ExactStateMixin:
    """Makes `state_dict` / `load_state_dict` round-trip exactly for states that are not the param's dtype.

    torch's Optimizer.load_state_dict casts every floating state to its parameter's dtype (fp32 Adafactor
    rows of a bf16 weight came back bf16, and the next lerp_ failed); and DeepSpeed loads checkpoints with a
    callable map_location, which torch refuses for torchao's 8-bit tensor subclass ("Callable map_location
    not supported with _rebuild_wrapper_subclass"). So subclass states are saved as their plain parts, and
    after torch's load every state is put back as saved.
    """

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {pid: {k: _pack(v) for k, v in st.items()} for pid, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        incoming = state_dict["state"]
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for k, v in incoming.get(pid, {}).items():
                self.state[p][k] = _unpack(v, p)


def _pack(v):
    if type(v).__name__ == "OptimState8bit":  # torchao's; matched by name so torchao stays optional here
        return {_PACKED: True, "codes": v.codes, "scale": v.scale, "qmap": v.qmap, "signed": v.signed, "dtype": v.dtype}
    return v


def _unpack(v, p):
    if isinstance(v, dict) and v.get(_PACKED):
        from torchao.optim.subclass_8bit import OptimState8bit

        return OptimState8bit(
            v["codes"].to(p.device), v["scale"].to(p.device), v["qmap"].to(p.device), v["signed"], dtype=v["dtype"]
        )
    return v.to(p.device) if isinstance(v, torch.Tensor) else v
