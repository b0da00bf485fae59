"""One weight's states: the leased tensor it rests as, its copy in the computation state, and the
placeholder the module holds between its unit's calls, which refuses any op but a move or cast to
where it already is."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._gguf import Packed, unpack
from .errors import ManageError, _name
from .lora import adapted


class _Placeholder(torch.Tensor):
    """What the module holds for a managed weight while its unit is not running: its shape, and
    the device and dtype it computes in (what module.device and .dtype, a pipeline's .to() and
    its execution device read), with no memory. A move or cast to where it already is keeps it;
    any other op is a ManageError naming the weight."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, name: str, shape, dtype: torch.dtype, device: torch.device):
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        placeholder.managed_name = name
        return placeholder

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"<vramd.manage's placeholder for {self.managed_name!r}: {list(self.shape)}, {_name(self.dtype)} "
                f"on {self.device}>")

    def __reduce_ex__(self, protocol):
        # torch.save(model.state_dict()) would otherwise write a file without a single value in it.
        raise ManageError(f"{self.managed_name!r} is managed by vramd: its placeholder has no values to save or "
                          "pickle (the weights are the leased model's, as its checkpoint holds them)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, _Placeholder))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter(), state_dict()
            return _Placeholder(first.managed_name, first.shape, first.dtype, first.device)
        where = f"{first.managed_name!r} is managed by vramd on {first.device} in {_name(first.dtype)}"
        if func is torch.ops.aten._to_copy.default:
            device, dtype = (kwargs or {}).get("device") or first.device, (kwargs or {}).get("dtype") or first.dtype
            raise ManageError(f"{where}: it cannot be moved or cast to {device} in {_name(dtype)}. A managed module "
                              "computes where manage() put it; close() ends the management")
        raise ManageError(f"{where}: it has values only while its unit runs, not for {func.__name__} outside it")


class _Slot:
    """One tensor the manager fills: a parameter (one object, whichever modules hold it) or a buffer."""

    def __init__(self, name: str, rest: torch.Tensor, packed: Packed | None, param: bool, places: list,
                 dtype: torch.dtype, device: torch.device, lora: list | None = None):
        self.name = name
        self.rest = rest            # the leased tensor, read-only, as the daemon holds it
        self.packed = packed        # its GGUF blocks' type and the values' shape, where it rests packed
        self.param = param          # a parameter, else a buffer
        # (module's _parameters or _buffers, attribute) wherever the module registers it
        kind = "_parameters" if param else "_buffers"
        self.places = [(getattr(module, kind), attribute) for module, attribute in places]
        self.dtype = dtype if rest.is_floating_point() or packed else rest.dtype
        self.device = device
        shape = packed.shape if packed else rest.shape
        self.set_lora(lora)  # its copy's bytes, or none as a view of the lease
        self.placeholder = self.inert(_Placeholder(name, shape, self.dtype, device))
        self.users = 0              # ready units that hold it

    def set_lora(self, lora: list | None) -> None:
        """Its LoRA terms (lora.py), moved to its device, or None; and what its copy then costs: a
        weight computing on the CPU in the leased dtype is a view of the lease, with no copy and
        no bytes, unless an adapter changes it."""
        self.lora = [(d.to(self.device), u.to(self.device), f, t) for d, u, f, t in lora] if lora else None
        self.in_place = self.device.type == "cpu" and self.rest.dtype == self.dtype and not self.packed and not lora
        shape = self.packed.shape if self.packed else self.rest.shape
        self.bytes = 0 if self.in_place else math.prod(shape) * self.dtype.itemsize
        self.read = 0 if self.in_place else self.rest.nbytes  # what a copy reads from the lease (packed: the blocks)

    def copy(self) -> torch.Tensor:
        """The tensor in its computation state: moved, then cast (or unpacked) on the device."""
        if self.in_place:
            return self.rest
        if self.lora:  # the adapters added in float32 on the device, then cast
            value = (unpack(self.rest.to(self.device, non_blocking=True), self.packed.type, self.packed.shape, torch.float32)
                     if self.packed else self.rest.to(self.device, torch.float32, non_blocking=True, copy=True))
            return adapted(value, self.lora).to(self.dtype)
        if self.packed:
            return unpack(self.rest.to(self.device, non_blocking=True), self.packed.type, self.packed.shape, self.dtype)
        # One call: a copy that does not block casts on the device, as torch's copy to a GPU says
        return self.rest.to(self.device, self.dtype, non_blocking=True)

    def inert(self, tensor: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(tensor, requires_grad=False) if self.param else tensor

    def put(self, value: torch.Tensor) -> None:
        """The value in every place the module registers it: one Parameter object for all of a
        tied parameter's places (a placeholder cannot take a real tensor's data in place)."""
        if self.param and type(value) is torch.Tensor:  # a copy; not isinstance: Parameter's is slow Python
            value = nn.Parameter(value, requires_grad=False)
        for entries, attribute in self.places:
            entries[attribute] = value
