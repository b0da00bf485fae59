"""A diffusers or transformers model of an architecture vramd does not compute, managed by vramd:
built on the meta device, filled from a lease of the daemon's copy (which rests in host memory in
its own dtype) and streamed through this process's device under a limit below its size. Checks
the output against the model loaded whole with the same dtypes.

    python examples/manage_module.py MODEL FOLDER [--device cuda:0]

FOLDER is what save_pretrained wrote (config.json and the safetensors file), and the daemon
serves it as MODEL with a config such as:

    checkpoint = "/models/unet/"
    architecture = "weights"
    dtype = "float32"
    [vram]
    onload = { device = "cpu", dtype = "bfloat16" }
    limit = "64MiB"
"""
import argparse
import contextlib
import glob
import json

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

import vramd


def model_class(folder):
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    if "_class_name" in config:  # diffusers
        import diffusers
        return getattr(diffusers, config["_class_name"]), "diffusers"
    import transformers
    return getattr(transformers, config["architectures"][0]), "transformers"


def build(cls, kind, folder, empty=True):
    """The model as from_config makes it: on the meta device (buffers real), or whole."""
    with init_empty_weights() if empty else contextlib.nullcontext():
        if kind == "diffusers":
            model = cls.from_config(cls.load_config(folder)).eval()
        else:
            import transformers
            model = cls(transformers.AutoConfig.from_pretrained(folder)).eval()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def whole(cls, kind, folder, managed):
    """The whole model, each weight rounded through the dtype it rests in, computed as `managed`."""
    reference = build(cls, kind, folder, empty=False)
    saved = {}
    for path in glob.glob(f"{folder}/*.safetensors"):
        saved |= load_file(path)
    rest = {name: t.dtype for name, t in managed.lease.state_dict.items()}
    reference.load_state_dict({name: t.to(rest[name]).to(managed.dtype) if t.is_floating_point() else t
                               for name, t in saved.items()}, strict=False)
    return reference.to(managed.device, managed.dtype)


def run(model, kind, device):
    generator = torch.Generator().manual_seed(0)
    if kind == "transformers":
        ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=generator).to(device)
        return model(input_ids=ids).logits
    config = model.config
    if hasattr(model, "decode"):  # a VAE: decode latents, an entry point other than forward
        latents = torch.randn(1, config.latent_channels, 8, 8, generator=generator).to(device)
        return model.decode(latents).sample
    size = config.sample_size
    sample = torch.randn(1, config.in_channels, size, size, generator=generator).to(device)
    if getattr(config, "cross_attention_dim", None):
        states = torch.randn(1, 4, config.cross_attention_dim, generator=generator).to(device)
        return model(sample, 10, states).sample
    return model(sample, 10).sample


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("folder")
    parser.add_argument("--device", default=None, help="default: the model config's [vram] computation device")
    args = parser.parse_args()
    cls, kind = model_class(args.folder)
    model = build(cls, kind, args.folder)
    with torch.no_grad(), vramd.connect() as client, vramd.manage(model, args.model, client=client,
                                                                   device=args.device) as managed:
        got = run(model, kind, managed.device)
        expected = run(whole(cls, kind, args.folder, managed), kind, managed.device)
        assert torch.equal(got, expected), (got - expected).abs().max()
        stats = managed.stats()
        size = sum(t.numel() * managed.dtype.itemsize for t in managed.lease.state_dict.values())
        peak, limit, size = (vramd.format_bytes(n) for n in (stats["peak"], stats["limit"], size))
        print(f"{args.model}: {cls.__name__} managed on {managed.device}, {peak} at most under a limit of {limit} "
              f"(the model: {size}), {stats['loads']} unit loads, "
              f"{stats['prefetch_hits']} prefetched in time; equals the whole model")


if __name__ == "__main__":
    main()
