"""A vramd converter (a Lua script: scripts/converters/README.md) that does to a checkpoint what
transformers 5 does as it loads it: the conversion rules transformers registers for the model's
type (transformers.conversion_mapping: renames, and experts stored one tensor each merged into
one), read from transformers itself and written out for this checkpoint's keys.

    python -m vramd.transformers_converter CHECKPOINT_FOLDER [-o converter.lua]

Then `converter = "converter.lua"` in the model's config (or `converter = "transformers"`, which
has the daemon run this for the config's own checkpoint) gives the daemon, its leases and
`vramd.manage` the names and layouts of the transformers module (a Mixtral's or a Qwen2-MoE's
fused experts, a GraniteMoE's renamed ones), each converted weight computed as it is read.
A rule vramd's converters cannot express is an error naming it; a model type with no rules
gives a converter that keeps every name.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


class ConversionError(ValueError):
    """The checkpoint's rules include one this converter cannot express, or there is no model to read them from."""


def _natural(key: str) -> list:
    """A sort key that orders experts.2 before experts.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


_PLAIN = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but for the quote and the backslash


def _lua(text: str) -> str:
    """A Lua string literal of `text` (three-digit decimal escapes for what is not printable ASCII,
    so that a digit after one is not read as part of it)."""
    if _PLAIN.fullmatch(text):  # nearly every tensor name: no escape to look for byte by byte
        return f'"{text}"'
    out = []
    for byte in text.encode():
        char = chr(byte)
        out.append(f"\\{byte:03d}" if byte < 32 or byte > 126 or char in "\\\"" else char)
    return '"' + "".join(out) + '"'


def convert_key(key: str, renamings: list, converters: list) -> tuple[str, list, str | None]:
    """What transformers' loader makes of a checkpoint key: every rename in turn, then the first
    converter whose pattern matches. Returns the name, the rules that changed it (the converter
    last, where one took it), and the converter's matching source pattern (None when none did)."""
    used = []
    for rule in renamings:
        key, pattern = rule.rename_source_key(key)
        if pattern is not None:
            used.append(rule)
    for rule in converters:
        target, pattern = rule.rename_source_key(key)
        if pattern is not None:
            return target, used + [rule], pattern
    return key, used, None


def conversion_rules(model) -> tuple[list, list, list]:
    """transformers' rules for `model`'s type (conversion_mapping), in order: its renamings, its
    converters, and rules of any other kind."""
    from transformers.conversion_mapping import WeightConverter, WeightRenaming, get_model_conversion_mapping
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)],
            [t for t in transforms if not isinstance(t, (WeightRenaming, WeightConverter))])


def checkpoint_keys(folder: Path) -> list[str]:
    """Every tensor name of a folder's safetensors files (model.safetensors, or the shards its index names)."""
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    keys = []
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def empty_model(folder: Path | None, values: dict | None = None, where: str | None = None):
    """The transformers model of the folder's config.json (or of `values`, such a file's
    contents, from `where`: what vramd read there, with a config's [arch] over it), its first
    `architectures` class (where `values` name none, as a GGUF file's do not, its causal LM), on
    the meta device."""
    import torch
    import transformers
    where = where or str(folder / "config.json")
    if values is None:
        config = transformers.AutoConfig.from_pretrained(folder)
    else:
        values = dict(values)
        try:
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        except (KeyError, ValueError) as error:
            raise ConversionError(f"{where}: transformers knows no configuration for it ({error})") from None
    names = getattr(config, "architectures", None) or []
    if not names and values is not None:
        # A GGUF file's metadata, which names no class: llama.cpp's files hold causal LMs.
        try:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise ConversionError(f"{where}: no architectures entry, and no causal LM of model type "
                                  f"{config.model_type!r} ({error})") from None
    model_class = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    if model_class is None:
        raise ConversionError(f"{where}: no architectures entry names a transformers class ({names})")
    with torch.device("meta"):
        return model_class(config)


def lua_converter(model, keys: list[str], where: str = "the checkpoint", converted: dict | None = None) -> str:
    """The converter's text for a transformers `model` (its class and config; its weights may be
    on the meta device) over a checkpoint holding `keys`. `converted`: convert_key of each key
    with conversion_rules(model), where the caller has it already."""
    from transformers.conversion_mapping import Chunk, Concatenate, MergeModulelist, Transpose
    renamings, converters, others = conversion_rules(model)
    if converted is None:
        converted = {key: convert_key(key, renamings, converters) for key in keys}
    for rule in others:  # a kind of rule this does not know would be a silent wrong name
        if any(rule.rename_source_key(k)[1] for k in keys):
            raise ConversionError(f"{where}: transformers' {type(rule).__name__} {rule.source_patterns} -> "
                                  f"{rule.target_patterns} is a kind of rule vramd.transformers_converter does not write")
    renamed: dict[str, str] = {}  # target -> source key
    merged: dict[str, tuple] = {}  # target -> (rule, {source pattern: [source keys]})
    # In one order whatever order the keys come in: the same checkpoint gives the same text (the
    # daemon shares one derived model between the clients sending it).
    for key in sorted(keys, key=_natural):
        name, used, pattern = converted[key]
        if pattern is not None:
            _, groups = merged.setdefault(name, (used[-1], {}))
            groups.setdefault(pattern, []).append(key)
            continue
        if name in renamed or name in merged:
            raise ConversionError(f"{where}: {key!r} and {renamed.get(name)!r} would both become {name!r}")
        renamed[name] = key
    lines = [f"-- Written by vramd.transformers_converter from transformers' conversion rules for model_type "
             f"{getattr(model.config, 'model_type', '?')!r} ({type(model).__name__}):",
             "-- each rename, and each merge of tensors into one, as transformers does them as it loads.",
             "local out = {}"]
    for name, key in renamed.items():
        lines.append(f"out[{_lua(name)}] = src[{_lua(key)}]")
    for target, (rule, groups) in merged.items():
        # Several targets (a fused q, k and v split in three): the first pattern's name, and the
        # others' in its place, as transformers expands them.
        targets = [target.replace(rule.target_patterns[0], pattern) for pattern in rule.target_patterns]
        values = {p: [f"src[{_lua(k)}]" for k in groups[p]] for p in rule.source_patterns if p in groups}  # in key order
        chunks = None
        for op in rule.operations:
            if isinstance(op, MergeModulelist):
                values = {p: [f"stack({{{', '.join(v)}}}, {op.dim})"] for p, v in values.items()}
            elif isinstance(op, Concatenate) and op.num_shards_attribute is None:
                values = {rule.source_patterns[0]: [f"cat({{{', '.join(x for v in values.values() for x in v)}}}, {op.dim})"]}
            elif isinstance(op, Transpose) and not op.check_dims:
                values = {p: [f"({x}):transpose({op.dim0}, {op.dim1})" for x in v] for p, v in values.items()}
            elif isinstance(op, Chunk) and op.num_shards_attribute is None and op is rule.operations[-1]:
                chunks = op.dim
            else:
                raise ConversionError(f"{where}: transformers' rule {rule.source_patterns} -> {rule.target_patterns} "
                                      f"for {target!r} takes {op!r}, which vramd's converters do not express "
                                      "(MergeModulelist, Concatenate, Transpose and a last Chunk they do)")
        results = [x for v in values.values() for x in v]
        if len(results) != 1 or (chunks is None) != (len(targets) == 1):
            raise ConversionError(f"{where}: transformers' rule {rule.source_patterns} -> {rule.target_patterns} "
                                  f"gives {len(results)} tensors for {len(targets)} targets ({targets[0]!r}), "
                                  "which vramd's converter does not match up")
        if chunks is None:
            lines.append(f"out[{_lua(target)}] = {results[0]}")
            continue
        parts = [f"part{i}" for i in range(len(targets))]
        lines.append(f"do local {', '.join(parts)} = ({results[0]}):chunk({len(parts)}, {chunks}); "
                     + " ".join(f"out[{_lua(t)}] = {p};" for t, p in zip(targets, parts)) + " end")
    lines.append("return out")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("checkpoint", type=Path, nargs="?", help="a folder with config.json and its safetensors files")
    parser.add_argument("-o", "--output", type=Path, help="the converter's file (default: standard output)")
    parser.add_argument("--stdin", action="store_true",
                        help='read {"config": config.json\'s values, "keys": the checkpoint\'s names, "where": '
                             'the folder or file to name in errors} as JSON on standard input instead (the daemon '
                             'does, for converter = "transformers")')
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (not args.stdin):
        parser.error("give a checkpoint folder or --stdin")
    try:
        if args.stdin:
            asked = json.load(sys.stdin)
            where = asked.get("where", "the checkpoint")
            text = lua_converter(empty_model(None, asked["config"], where), asked["keys"], where)
        else:
            text = lua_converter(empty_model(args.checkpoint), checkpoint_keys(args.checkpoint), str(args.checkpoint))
    except (ConversionError, OSError, ValueError, KeyError) as error:
        print(f"vramd.transformers_converter: {error}", file=sys.stderr)
        return 1
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
