"""Hugging Face transformers' tensor parallelism (tp_plan="auto") under
``torch.compile(model, fullgraph=True)``, as a user runs it under torchrun: a compiled training
forward and backward (transformers' DTensor path) and a compiled no-grad forward (its layers'
own ``dist.all_reduce`` over ``mesh.get_group()``), each compiled before any eager call and
compared with the eager model.  Prints one JSON line per rank.
Usage: torchrun --nproc-per-node N [-m shardtensor.dropin] hf_tp_compiled.py MODEL_DIR"""
import json
import sys

import torch
import torch.distributed as dist

from hf_tp import TOKENS


def main(path: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    tokens = torch.tensor(TOKENS)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        infer = compiled(tokens).logits.float()
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        eager_infer = model(tokens).logits.float()
    eager_loss = model(tokens, labels=tokens).loss
    eager_loss.backward()
    grad_diff = max(float((grads[n] - (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)).abs().max())
                    for n, p in model.named_parameters())
    print(json.dumps({"rank": dist.get_rank(), "loss": [loss.item(), eager_loss.item()],
                      "logits_diff": float((infer - eager_infer).abs().max()), "grad_diff": grad_diff}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
