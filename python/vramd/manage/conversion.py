"""Whether the names a module lacks are what transformers makes of the leased ones as it loads:
transformers 5 converts many checkpoints at load time by rules registered per model type
(transformers.conversion_mapping: renames, and experts stacked one tensor per expert into
one). vramd.manage then has the daemon apply them (converter_for: a converter it derives a model
with, materialised once and shared), or, with convert=False, its ManageError says so."""
from __future__ import annotations

from torch import nn

from ..transformers_converter import ConversionError, conversion_rules, convert_key, lua_converter
from .errors import ManageError, _listed


def _transformers_model(module: nn.Module) -> bool:
    """Whether `module` is a transformers PreTrainedModel, asked of its classes' names: importing
    transformers' modeling code to ask isinstance would cost a process that has not tens of MB."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


def converter_for(module: nn.Module, leased: list[str], model: str) -> str | None:
    """The Lua converter that does transformers' own load-time conversion of the leased names,
    when `module` lacks names that conversion makes of them (else None: the lease is used as it
    is). A rule vramd's converters cannot express is a ManageError naming it."""
    if not _transformers_model(module):
        return None
    names = set(leased)
    missing = [name for name in module.state_dict(keep_vars=True) if name not in names]
    converted = {}
    if not missing or not conversion_hint(module, leased, missing, converted)[1]:
        return None
    try:
        return lua_converter(module, leased, f"model {model!r}", converted)
    except ConversionError as error:
        raise ManageError(f"{error}; {type(module).__name__} needs transformers' conversion of the leased names, "
                          "which vramd cannot apply: serve a checkpoint in the module's own names") from None


def conversion_hint(module: nn.Module, leased: list[str], missing: list[str],
                    converted: dict | None = None) -> tuple[str | None, list[str]]:
    """A sentence naming the rules of transformers' own conversion that turn leased names into
    the missing ones, when the module is a transformers model whose type has such rules and
    they give at least one of them (else None), and the missing names they give. `converted`
    takes convert_key of each leased name, for lua_converter."""
    if not _transformers_model(module):
        return None, []
    try:
        from transformers.conversion_mapping import WeightConverter
    except ImportError:  # transformers is too old to convert at load time
        return None, []
    try:
        renamings, converters, _ = conversion_rules(module)
    except Exception:  # noqa: BLE001 - a model whose mapping cannot be made has none to suggest
        return None, []
    converted = {} if converted is None else converted
    produced, used = set(), {}
    for key in leased:
        name, rules, _ = converted[key] = convert_key(key, renamings, converters)
        produced.add(name)
        for rule in rules:
            used.setdefault(id(rule), rule)
    matched = [name for name in missing if name in produced]
    if not matched:
        return None, []

    def described(rule) -> str:  # its patterns as they read, without their regular expressions' escapes
        what = "merged into" if isinstance(rule, WeightConverter) else "renamed"
        return " ".join([", ".join(p.replace("\\", "") for p in rule.source_patterns), what,
                         ", ".join(p.replace("\\", "") for p in rule.target_patterns)])

    model_type = getattr(getattr(module, "config", None), "model_type", "?")
    which = "all of them are" if len(matched) == len(missing) else f"{len(matched)} of them ({_listed(matched)}) are"
    return (f"{which} what transformers' own conversion for model_type {model_type!r} makes of the leased names as "
            f"it loads ({'; '.join(described(r) for r in used.values())}), "
            "which vramd.manage applies (in a model the daemon derives) unless given convert=False; or name it "
            "in the model's config, converter = \"transformers\", for the daemon's leases and tools to see it too "
            "(or a converter file written by `python -m vramd.transformers_converter CHECKPOINT_FOLDER -o "
            "converter.lua`)"), matched
