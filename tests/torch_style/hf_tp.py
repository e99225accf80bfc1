"""Hugging Face transformers' own tensor parallelism (tp_plan="auto") on a tiny model built and
saved locally (no download), as a user runs it under torchrun.  Prints one JSON line per rank:
logits checksum, greedy tokens, losses of a few AdamW steps, whose DTensor ran.
Usage: torchrun --nproc-per-node N [-m shardtensor.dropin] hf_tp.py MODEL_DIR DTYPE SAVE_DIR"""
import json
import sys

import torch
import torch.distributed as dist


TOKENS = [[1, 5, 9, 3, 7, 2, 4, 8]]


def build(kind: str, path: str) -> None:
    """A tiny random model of ``kind`` (llama, qwen3), saved at ``path``: 4 heads, so 2 and 4 ranks split them."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, head_dim=8)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind](**sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def run(model) -> dict:
    """Forward, greedy generation and three AdamW steps: what every run reports."""
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = model(tokens).logits
    gen = model.generate(tokens, max_new_tokens=6, do_sample=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"logits": float(logits.double().abs().sum()), "generated": gen[0].tolist(), "losses": losses}


def main(path: str, dtype: str, save: str) -> None:
    from transformers import AutoModelForCausalLM
    from torch.distributed.tensor import DTensor

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=getattr(torch, dtype))
    out = run(model)
    model.save_pretrained(save)
    print(json.dumps({"rank": dist.get_rank(), **out, "dtensor": DTensor.__module__,
                      "dtype": str(next(model.parameters()).dtype)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
