"""What is managed: the module's parameters and buffers matched to the leased tensors (a slot
each), grouped into units, and the most bytes units hold while they run one inside another."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .conversion import conversion_hint
from .errors import ManageError, _listed
from .hooks import _MANAGED
from .slot import _Slot
from .unit import _Unit, _enclosing


class _Plan:
    """Managed's plan of its slots and units, made once in manage()."""

    def _plan(self, names: list[str] | None, strict: bool) -> list[_Unit]:
        leased, packs = self.lease.state_dict, self.lease.packed
        every = dict(self.module.named_modules(remove_duplicate=False))
        # Each parameter and buffer object once, with every name it has and every place it is registered.
        aliases: dict[int, list[str]] = {}
        found: dict[int, tuple[torch.Tensor, bool, list]] = {}
        for module_name, module in every.items():
            for kind in ("_parameters", "_buffers"):
                for attribute, tensor in getattr(module, kind).items():
                    if tensor is None:
                        continue
                    aliases.setdefault(id(tensor), []).append(f"{module_name}.{attribute}" if module_name else attribute)
                    _, _, places = found.setdefault(id(tensor), (tensor, kind == "_parameters", []))
                    if (module, attribute) not in places:
                        places.append((module, attribute))
        managed = [name or type(self.module).__name__ for name, module in every.items() if module in _MANAGED]
        if managed:  # each manager would put its copies and placeholders in the other's place
            raise ManageError(f"{type(self.module).__name__} is managed already: {_listed(managed)} under a "
                              "vramd.manage that has not been closed; close() it first")
        slots: dict[int, _Slot] = {}
        missing, mismatched = [], []
        for key, (tensor, is_param, places) in found.items():
            name = next((n for n in aliases[key] if n in leased), None)
            if name is None:
                if is_param or tensor.is_meta:
                    missing.append(aliases[key][0])
                elif tensor.device != self.device:  # a buffer of the module's own: where it computes
                    for module, attribute in places:
                        module._buffers[attribute] = tensor.to(self.device)
                continue
            rest, packed = leased[name], packs.get(name)
            shape = packed.shape if packed else tuple(rest.shape)
            if shape != tuple(tensor.shape):
                mismatched.append(f"{name!r} is {list(shape)} leased, {list(tensor.shape)} in the module")
                continue
            slots[key] = _Slot(name, rest, packed, is_param, places, self.dtype, self.device, self._lora.get(name))
        unexpected = sorted(set(leased) - {n for key in slots for n in aliases[key]})
        problems = []
        if mismatched:
            problems.append(f"{len(mismatched)} mismatched: " + ", ".join(mismatched[:8]) +
                            (", ..." if len(mismatched) > 8 else ""))
        if missing:
            hint, converted = conversion_hint(self.module, list(leased), missing)
            problems.append(f"{len(missing)} without a leased tensor: " + _listed(missing) + (f"; {hint}" if hint else ""))
            if hint is None and any(name.startswith("blk.") for name in leased):
                problems[-1] += ("; the leased names are a GGUF file's own (llama.cpp's, such as 'blk.0.attn_q.weight'), "
                                 "which transformers' load-time conversion does not read and vramd.manage does not "
                                 "convert: serve the model's safetensors (as save_pretrained writes them)")
            elif len(converted) < len(missing):
                problems[-1] += ((f"; the other {len(missing) - len(converted)}" if hint else "") +
                                 " (buffers made on the meta device: build the module with accelerate.init_empty_weights(), "
                                 "which leaves buffers real, or lease a checkpoint that holds them)")
        if strict and unexpected:
            problems.append(f"{len(unexpected)} leased tensors the module does not hold: " + _listed(unexpected) +
                            " (strict=False leaves them out)")
        if problems:
            raise ManageError(f"model {self.lease.manifest['model']!r} does not fit {type(self.module).__name__}: " +
                              "; ".join(problems))

        # Each slot's units: the innermost given unit that holds it, else the module holding it directly.
        given = list(names or [])
        for name in given:
            if name not in every:
                raise ManageError(f"unit {name!r} is not a module of {type(self.module).__name__}")
            if type(every[name]).forward is nn.Module.forward:  # a ModuleList, say: only its modules run
                raise ManageError(f"unit {name!r} is a {type(every[name]).__name__}, which is never called (only the "
                                  "modules it holds are): name those")

        def covering(path: str) -> str | None:
            named = [n for n in given if n == "" or path == n or path.startswith(n + ".")]
            return max(named, key=len) if named else None

        paths: dict[int, list[str]] = {}  # a module shared by several parents runs under each of them
        for path, module in every.items():
            paths.setdefault(id(module), []).append(path)
        by_unit: dict[str, list[_Slot]] = {}
        for module_name, module in self.module.named_modules():
            # Its weights' unit: the innermost given unit over each of its paths, where all agree; else
            # the module itself (called from outside a given unit, its weights must come with it).
            owners = {covering(path) for path in paths[id(module)]}
            owner = owners.pop() if len(owners) == 1 else None
            for kind in ("_parameters", "_buffers"):
                for tensor in getattr(module, kind).values():
                    slot = slots.get(id(tensor)) if tensor is not None else None
                    if slot is None:
                        continue
                    unit = by_unit.setdefault(owner if owner is not None else module_name, [])
                    if slot not in unit:
                        unit.append(slot)
        units = [_Unit(name, every[name], paths[id(every[name])], unit_slots) for name, unit_slots in by_unit.items()]
        held = Counter(slot for unit in units for slot in unit.slots)
        for unit in units:
            unit.shares = any(held[slot] > 1 for slot in unit.slots)
        return units

    def _most_held_at_once(self) -> tuple[int, list[_Unit]]:
        """The most bytes units hold while they run one inside another (a module holding weights of
        its own around the units under it: it is in use while they run), and those units, the
        outermost first. A unit alone is the least of it."""
        at = {path: unit for unit in self._units for path in unit.paths}
        most, nested = 0, []
        for unit in self._units:
            for path in unit.paths:
                around = [at[p] for p in _enclosing(path) if p in at]
                chain = list(dict.fromkeys(around + [unit]))
                held = sum(slot.bytes for slot in {slot for u in chain for slot in u.slots})
                if held > most:
                    most, nested = held, chain
        return most, nested
