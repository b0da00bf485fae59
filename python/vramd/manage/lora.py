"""LoRA adapters a managed module applies itself (manage(..., loras=), Managed.set_loras): read and
checked whole in this process, then added to each weight they name as its unit is brought to the
device, in float32 there: W + scale * alpha / r * B A, as the daemon's [[lora]] adds them
(docs/models.md, "LoRA adapters"). The leased weights, the daemon's, never change: processes
leasing one model can each run it under adapters of their own."""
from __future__ import annotations

import json
import math
import os
import re

import torch
from torch import nn

from .. import _safetensors
from .errors import ManageError

# A key's suffix, and which factor it holds.
_SUFFIXES = [(".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_down.weight", "down"),
             (".lora_up.weight", "up"), (".lora.down.weight", "down"), (".lora.up.weight", "up"),
             (".lora_embedding_A", "embedding down"), (".lora_embedding_B", "embedding up"), (".alpha", "alpha")]
_REFUSED = [("lora_magnitude_vector", "DoRA"), (".dora_scale", "DoRA"), (".hada_w", "LoHa"), (".lokr_w", "LoKr"),
            (".lora_B.bias", "a LoRA with a bias"), (".lora_up.bias", "a LoRA with a bias"),
            (".base_layer.", "a whole weight saved beside the adapter")]


def _open(path: str):
    """The adapter's tensors, and its PEFT config (a folder's adapter_config.json) or None."""
    if os.path.isdir(path):
        config_path, tensors_path = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
        if not os.path.exists(config_path):
            raise ManageError(f"{path}: a folder without adapter_config.json is no PEFT adapter")
        if not os.path.exists(tensors_path):
            raise ManageError(f"{path}: no adapter_model.safetensors beside its adapter_config.json")
        with open(config_path) as f:
            config = json.load(f)
        if config.get("peft_type", "LORA") != "LORA":
            raise ManageError(f"{config_path}: peft_type {config['peft_type']!r} is not supported: LoRA adapters only")
        if config.get("use_dora"):
            raise ManageError(f"{config_path}: use_dora = true: DoRA is not supported, only LoRA")
        path = tensors_path
    elif not os.path.exists(path):
        raise ManageError(f"{path}: no such file or folder")
    else:
        config = None
    # One read, the factors views of it: a file of hundreds of small tensors is read in a
    # fraction of the time safetensors' load_file takes for it.
    try:
        with open(path, "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
    except OSError as e:
        raise ManageError(f"{path}: {e.strerror}") from None
    try:
        if got != len(data):
            raise ValueError(f"{got} bytes read of {len(data)}")
        return _safetensors.loads(data, copy=False), config
    except ValueError as e:  # a truncated or foreign file
        raise ManageError(f"{path}: not a safetensors file: {e}") from None


def _pattern(patterns: dict, module: str):
    """peft's get_pattern_key: the first pattern matching the end of the module's name at a dot."""
    for pattern, value in patterns.items():
        try:
            if re.fullmatch(rf"(.*\.)?({pattern})", module):
                return value
        except re.error:
            raise ManageError(f"pattern {pattern!r} is no regular expression") from None
    return None


def _component(name: str) -> str | None:
    """The component of a kohya module name (lora_unet_..., lora_te_...: "unet", "te"), else None."""
    return name.split("_", 2)[1] if name.startswith("lora_") and name.count("_") >= 2 else None


def module_index(module: nn.Module) -> tuple[dict, dict]:
    """The module's submodules by name, and their names by the underscored spelling kohya's keys
    use: what read_loras looks adapters' modules up in (made once for a managed module)."""
    modules = dict(module.named_modules())
    return modules, {name.replace(".", "_"): name for name in modules}


def read_loras(loras, module: nn.Module, label: str = "loras", index: tuple | None = None) -> dict[str, list[tuple]]:
    """Each (path, scale) of `loras` (or a path alone: scale 1.0) read and checked whole against
    `module`: the weights it changes by name, each with its terms (down, up, factor, transposed),
    float32 on the CPU. The keys of a kohya file's component none of whose modules are the
    module's (a text encoder's, lora_te_, beside a UNet's) are skipped, as the daemon skips them.
    Raises ManageError naming the adapter (`label`[N]) and key. `index`: module_index(module)."""
    modules, underscored = index or module_index(module)
    terms: dict[str, list[tuple]] = {}
    for n, lora in enumerate(loras):
        path, scale = (lora, 1.0) if isinstance(lora, (str, os.PathLike)) else lora
        path = os.fspath(path)
        where = f"{label}[{n}], {path}"
        try:
            tensors, peft = _open(path)
            pairs: dict[str, dict] = {}
            for key, value in tensors.items():
                refused = next((what for part, what in _REFUSED if part in key), None)
                if refused:
                    raise ManageError(f"{key!r} is {refused}, which vramd does not apply")
                suffix = next(((s, part) for s, part in _SUFFIXES if key.endswith(s)), None)
                if suffix is None:
                    raise ManageError(f"{key!r} is no LoRA key (lora_A/lora_B, lora_down/lora_up or alpha)")
                name = key[: -len(suffix[0])].removeprefix("base_model.model.")
                pairs.setdefault(name, {})[suffix[1]] = value
            components = {name: _component(name) for name in pairs}
            targets = {name: (underscored.get(name.split("_", 2)[2]) if component
                              else name if name in modules else name.split(".", 1)[1] if "." in name else None)
                       for name, component in components.items()}
            found = {component for name, component in components.items() if targets[name] and component}
            skipped = {name for name, component in components.items() if component and component not in found}
            if pairs and len(skipped) == len(pairs):
                raise ManageError(f"module {next(iter(pairs))!r} is not the module's, nor any other of the file's")
            for name, pair in pairs.items():
                target = targets[name]
                if name in skipped:
                    continue  # another component's (kohya's lora_te_ beside lora_unet_)
                layer = modules.get(target) if target else None
                weight = getattr(layer, "weight", None) if layer is not None else None
                if not isinstance(weight, torch.Tensor):
                    raise ManageError(f"module {name!r} is not the module's (or has no weight); an adapter on "
                                      "the checkpoint's modules where a converter joins them (a Mixtral's "
                                      "experts.N.w1 stacked into experts.gate_up_proj) is the daemon's to apply: "
                                      "give the served model its [[lora]] instead")
                embedding = "embedding down" in pair or "embedding up" in pair
                down, up = pair.get("embedding down" if embedding else "down"), pair.get("embedding up" if embedding else "up")
                if down is None or up is None:
                    raise ManageError(f"{name!r} has no {'down (lora_A)' if down is None else 'up (lora_B)'} factor")
                down, up = down.float(), up.float()
                transposed = embedding or type(layer).__name__ == "Conv1D"
                shape = tuple(weight.shape)
                rank = down.shape[0]
                if len(shape) == 4 and down.dim() != 4:
                    raise ManageError(f"{name!r}: a {down.dim()}-D adapter on a convolution, whose weight is {list(shape)}")
                if up.dim() < 2 or up.shape[1] != rank:
                    raise ManageError(f"{name!r}: rank mismatch: its down factor has {rank} rows, its up factor "
                                      f"{list(up.shape)} columns")
                if len(shape) == 4:
                    wanted = (rank, *shape[1:]), (shape[0], rank, 1, 1)
                elif len(shape) == 2:
                    wanted = ((rank, shape[0]), (shape[1], rank)) if transposed else ((rank, shape[1]), (shape[0], rank))
                else:
                    wanted = None
                if wanted is None or (tuple(down.shape), tuple(up.shape)) != wanted:
                    raise ManageError(f"{name!r}: factors {list(down.shape)} and {list(up.shape)} do not fit its weight "
                                      f"{list(shape)}")
                alpha = float(rank)
                if peft is not None:
                    expected = _pattern(peft.get("rank_pattern") or {}, target) or peft["r"]
                    if expected != rank:
                        raise ManageError(f"{name!r}: rank mismatch: adapter_config.json says r = {expected}, its "
                                          f"factors have rank {rank}")
                    alpha = float(_pattern(peft.get("alpha_pattern") or {}, target) or peft.get("lora_alpha", rank))
                elif "alpha" in pair:
                    alpha = float(pair["alpha"].item())
                per_rank = math.sqrt(rank) if peft is not None and peft.get("use_rslora") else rank
                terms.setdefault(f"{target}.weight", []).append((down, up, float(scale) * alpha / per_rank, transposed))
        except ManageError as e:
            raise ManageError(f"{where}: {e}") from None
    return terms


def adapted(value: torch.Tensor, terms: list[tuple]) -> torch.Tensor:
    """`value` (float32, on the terms' device) plus every term, in peft's order: each product
    times its factor, then added."""
    for down, up, factor, transposed in terms:
        delta = (up.flatten(1) @ down.flatten(1)) * factor
        value += (delta.T if transposed else delta).reshape(value.shape)
    return value


def merged(*term_sets: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Terms of several sets in order: each weight's terms of the first set, then the next's."""
    out: dict[str, list[tuple]] = {}
    for terms in term_sets:
        for name, listed in terms.items():
            out.setdefault(name, []).extend(listed)
    return out


def served_loras(lease, module: nn.Module, index: tuple | None = None) -> dict[str, list[tuple]]:
    """The terms of the adapters the leased model leaves to its clients (Lease.loras: a "weights"
    model served with fuse_lora = false), read here as the daemon read them. ManageError naming
    the model and the adapter."""
    try:
        return read_loras(lease.loras, module, label="its loras", index=index)
    except ManageError as e:
        raise ManageError(f"model {lease.manifest.get('model')!r}'s adapters, which its clients apply: {e}") from None
