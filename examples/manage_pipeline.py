"""A diffusers pipeline on modules vramd manages: DiTPipeline, its transformer and its VAE each
built on the meta device and filled from a lease of the daemon's copy, each under the limit of its
model's config, or with --share both under the transformer's (they run one after the other: the
VAE takes the room the transformer's units held, and the daemon holds one reservation). The
pipeline is used as with whole modules (its .to(), device and dtype see where the managed ones
compute); checks its images against the same pipeline on the whole modules.

    python examples/manage_pipeline.py TRANSFORMER TRANSFORMER_FOLDER VAE VAE_FOLDER [--device cuda:0] [--share]

TRANSFORMER is a DiTTransformer2DModel and VAE an AutoencoderKL (whose latents the transformer
makes), each a folder save_pretrained wrote, served as `architecture = "weights"` with a [vram]
table, as examples/manage_module.py says.
"""
import argparse
import contextlib

import numpy
import torch
from diffusers import DDIMScheduler, DiTPipeline

import vramd
from manage_module import build, model_class, whole


def images(transformer, vae, device):
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    return pipe(class_labels=[1, 7], num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                output_type="np").images


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("transformer")
    parser.add_argument("transformer_folder")
    parser.add_argument("vae")
    parser.add_argument("vae_folder")
    parser.add_argument("--device", default=None, help="default: the models' [vram] computation device")
    parser.add_argument("--share", action="store_true", help="the VAE under the transformer's limit")
    args = parser.parse_args()
    models = {args.transformer: args.transformer_folder, args.vae: args.vae_folder}
    with torch.no_grad(), vramd.connect() as client, contextlib.ExitStack() as stack:
        managed = {}
        for name, folder in models.items():
            cls, kind = model_class(folder)
            first = managed.get(args.transformer) if args.share else None
            managed[name] = stack.enter_context(vramd.manage(build(cls, kind, folder), name, client=client,
                                                             device=None if first else args.device, share=first))
        transformer, vae = (managed[name].module for name in (args.transformer, args.vae))
        device = managed[args.transformer].device
        got = images(transformer, vae, device)
        references = [whole(*model_class(models[name]), models[name], managed[name])
                      for name in (args.transformer, args.vae)]
        expected = images(*references, device)
        assert numpy.array_equal(got, expected), abs(got - expected).max()
        for name, m in managed.items():
            stats = m.stats()
            limit = vramd.format_bytes(stats["limit"])
            limit = f"the limit of {limit} it shares" if args.share else f"a limit of {limit}"
            peak = vramd.format_bytes(stats["peak"])
            print(f"{name}: {type(m.module).__name__} managed on {m.device}, {peak} at most under {limit}, "
                  f"{stats['loads']} unit loads")
        print(f"DiTPipeline on managed modules: {len(got)} images equal to the pipeline's on the whole modules")


if __name__ == "__main__":
    main()
