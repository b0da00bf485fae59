"""A diffusers model filled from a vramd lease: vramd serves the checkpoint of an architecture it
does not know itself (`architecture = "weights"`), converters and dtypes applying as for every
model, and the client brings the code. Checks the output against from_pretrained's.

    python examples/lease_diffusers.py MODEL FOLDER

FOLDER is what save_pretrained wrote (config.json and diffusion_pytorch_model.safetensors), and
the daemon serves it as MODEL with a config such as:

    checkpoint = "/models/unet/"
    architecture = "weights"
"""
import inspect
import json
import sys

import diffusers
import torch
from accelerate import init_empty_weights

import vramd


def main():
    name, folder = sys.argv[1], sys.argv[2]
    with open(f"{folder}/config.json") as f:
        model_class = getattr(diffusers, json.load(f)["_class_name"])  # e.g. UNet2DModel, UNet2DConditionModel
    with init_empty_weights():
        model = model_class.from_config(model_class.load_config(folder)).eval()
    reference = model_class.from_pretrained(folder).eval()
    args = inputs(model)
    with vramd.connect() as client, client.lease(name) as state_dict:
        missing, unexpected = model.load_state_dict(state_dict, strict=True, assign=True)
        with torch.no_grad():
            got = model(**args).sample
            expected = reference(**args).sample
        assert torch.equal(got, expected), (got - expected).abs().max()
        print(f"{name}: {len(state_dict)} tensors leased, {model_class.__name__} output equals from_pretrained's")


def inputs(model):
    """A random sample and a timestep; and for a model conditioned on text (UNet2DConditionModel,
    which takes it as a required argument), hidden states of its cross-attention width."""
    generator = torch.Generator().manual_seed(0)
    size = model.config.sample_size
    size = size if isinstance(size, int) else size[0]
    args = {"sample": torch.randn(1, model.config.in_channels, size, size, generator=generator), "timestep": 10}
    if "encoder_hidden_states" in inspect.signature(model.forward).parameters:
        width = model.config.cross_attention_dim
        width = width if isinstance(width, int) else width[0]
        args["encoder_hidden_states"] = torch.randn(1, 5, width, generator=generator)
    return args


if __name__ == "__main__":
    main()
