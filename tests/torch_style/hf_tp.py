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
    """A tiny random model of ``kind`` (llama, qwen3, qwen3_moe), saved at ``path``: 4 heads, so 2
    and 4 ranks split them; the MoE's 4 experts each have a fused gate/up weight."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, head_dim=8)
    if kind == "qwen3_moe":
        sizes.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[kind](**sizes)
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


def load_kwargs(path: str, dtype: str) -> dict:
    """``from_pretrained``'s arguments: the dtype, and for an MoE in float64 the eager experts
    (torch's grouped matmul, transformers' default, has no float64 kernel)."""
    from transformers import AutoConfig

    moe = "moe" in AutoConfig.from_pretrained(path).model_type
    return {"dtype": getattr(torch, dtype), **({"experts_implementation": "eager"} if moe and dtype == "float64" else {})}


def main(path: str, dtype: str, save: str) -> None:
    from transformers import AutoModelForCausalLM
    from torch.distributed.tensor import DTensor

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", **load_kwargs(path, dtype))
    out = run(model)
    model.save_pretrained(save)
    packed = [repr(p.placements) for n, p in model.named_parameters() if n.endswith("gate_up_proj")]
    print(json.dumps({"rank": dist.get_rank(), **out, "dtensor": DTensor.__module__,
                      "dtype": str(next(model.parameters()).dtype), "packed": packed[:1]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
